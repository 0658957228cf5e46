"""Issue 14, hole 6: /openapi.json omitted POST /v1/chat/completions, every query parameter and
every error answer. The document now describes every route; here its schemas are checked against
what the running server actually answers (tests/e2e/test_api_fuzz.py then fuzzes it)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import jsonschema_rs
import pytest

from tests.e2e.conftest import MODEL, Server, auth, poll, short_body

pytestmark = pytest.mark.e2e

OPERATIONS = {
    ("/v1/chat/completions", "post"),
    ("/v1/models", "get"),
    ("/v1/billing/usage", "get"),
    ("/v1/billing/ledger", "get"),
    ("/v1/billing/invoices/{tenant}", "get"),
    ("/v1/billing/reconciliation", "get"),
    ("/v1/billing/goodput", "get"),
    ("/v1/fleet", "get"),
    ("/v1/requests/{request_id}/events", "get"),
    ("/v1/requests", "get"),
    ("/v1/runs", "post"),
    ("/v1/runs/{run_id}", "get"),
    ("/v1/runs/{run_id}/end", "post"),
    ("/healthz", "get"),
    ("/readyz", "get"),
    ("/metrics", "get"),
    ("/v1/files", "post"),
    ("/v1/files/{file_id}", "get"),
    ("/v1/files/{file_id}", "delete"),
    ("/v1/files/{file_id}/content", "get"),
    ("/v1/batches", "post"),
    ("/v1/batches", "get"),
    ("/v1/batches/{batch_id}", "get"),
    ("/v1/batches/{batch_id}/cancel", "post"),
    ("/v1/feedback", "post"),
    # The admin API and the audit trail (admin keys)
    ("/v1/admin/tenants", "get"),
    ("/v1/admin/tenants", "post"),
    ("/v1/admin/tenants/{tenant}/plan", "post"),
    ("/v1/admin/tenants/{tenant}/keys", "post"),
    ("/v1/admin/tenants/{tenant}/keys/{key_id}/revoke", "post"),
    ("/v1/admin/tenants/{tenant}/keys/{key_id}/project", "post"),
    ("/v1/admin/tenants/{tenant}/limits", "post"),
    ("/v1/admin/tenants/{tenant}/limits", "get"),
    ("/v1/admin/tenants/{tenant}/workspaces", "post"),
    ("/v1/admin/tenants/{tenant}/projects", "post"),
    ("/v1/admin/tenants/{tenant}/budgets", "post"),
    ("/v1/admin/tenants/{tenant}/time-zone", "post"),
    ("/v1/admin/prices", "post"),
    ("/v1/admin/prices/flex-discount", "post"),
    ("/v1/admin/models", "post"),
    ("/v1/admin/models/{model}", "get"),
    ("/v1/admin/tenants/{tenant}/adapters", "post"),
    ("/v1/admin/tenants/{tenant}/adapters", "get"),
    ("/v1/admin/tenants/{tenant}/adapters/{adapter}", "get"),
    ("/v1/admin/tenants/{tenant}/adapters/{adapter}/revoke", "post"),
    ("/v1/admin/tenants/{tenant}/adapters/{adapter}/price", "post"),
    ("/v1/admin/tenants/{tenant}/residency", "post"),
    ("/v1/admin/tenants/{tenant}/residency/clear", "post"),
    ("/v1/admin/tenants/{tenant}/retention", "post"),
    ("/v1/admin/tenants/{tenant}/data-policy", "get"),
    ("/v1/audit", "get"),
    ("/v1/audit/verify", "get"),
    ("/v1/routing/savings", "get"),
}
PUBLIC = {"/healthz", "/readyz", "/metrics"}
QUERY_PARAMETERS: dict[Any, set[str]] = {
    ("/v1/batches", "get"): {"after", "limit"},
    "/v1/billing/usage": {"tenant", "from", "to", "model", "group_by", "format"},
    "/v1/billing/ledger": {"tenant", "from", "to", "model", "format", "limit", "after"},
    "/v1/billing/invoices/{tenant}": {"period", "format"},
    "/v1/billing/reconciliation": {"from", "to"},
    "/v1/billing/goodput": {"tenant", "from", "to", "group_by", "format"},
    "/v1/routing/savings": {"tenant", "month", "format"},
    "/v1/requests": {"tenant", "from", "to", "status", "key_id", "model", "limit", "after"},
    ("/v1/admin/tenants/{tenant}/limits", "get"): {"model", "at"},
    "/v1/admin/models/{model}": {"at"},
    "/v1/audit": {"tenant", "since", "actor", "limit", "after"},
}


@pytest.fixture(scope="module")
def document(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.base}/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()


def conforms(document: dict[str, Any], schema_name: str, value: Any) -> None:
    """Validate `value` against components.schemas[schema_name] (its refs resolved in the
    document)."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
    errors = [e.message for e in jsonschema_rs.validator_for(schema).iter_errors(value)]
    assert not errors, f"{schema_name}: {errors[:5]} in {json.dumps(value)[:800]}"


def response_schema(document: dict[str, Any], path: str, method: str, status: int) -> str:
    answer = document["paths"][path][method]["responses"][str(status)]
    return str(answer["content"]["application/json"]["schema"]["$ref"]).rsplit("/", 1)[1]


def test_every_route_is_described_with_its_parameters_and_errors(document: dict[str, Any]) -> None:
    described = {(p, m) for p, methods in document["paths"].items() for m in methods}
    assert described == OPERATIONS
    # Each operation has an id of its own (a client generator names its methods after them).
    ids = [op["operationId"] for methods in document["paths"].values() for op in methods.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path, method in OPERATIONS:
        operation = document["paths"][path][method]
        statuses = set(operation["responses"])
        assert "200" in statuses, path
        if path in PUBLIC:
            assert "security" not in operation
            continue
        assert operation["security"] == [{"bearer": []}]
        assert {"401", "403", "429"} <= statuses, (path, statuses)
        for status in statuses - {"200"}:
            answer = operation["responses"][status]
            assert answer["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }
            assert "X-Request-Id" in answer["headers"]
            if status in {"429", "503"}:
                assert "Retry-After" in answer["headers"]
        query = {p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"}
        expected = QUERY_PARAMETERS.get((path, method), QUERY_PARAMETERS.get(path, set()))
        assert query == expected, path
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest"
    )
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404", "409", "413", "422", "429", "502", "503"} <= set(chat["responses"])
    assert [p["name"] for p in chat["parameters"]] == [
        "Idempotency-Key", "X-Tollgate-Run-Id", "X-Tollgate-End-User"
    ]
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_request_example_is_a_model_on_sale_and_is_served(
    server: Server, document: dict[str, Any]
) -> None:
    chat = document["paths"]["/v1/chat/completions"]["post"]
    example = chat["requestBody"]["content"]["application/json"]["example"]
    conforms(document, "ChatCompletionRequest", example)
    models = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
    assert MODEL in models["examples"]
    r = httpx.post(f"{server.base}/v1/chat/completions", json=example,
                   headers=auth(server.keys["demo-standard"]), timeout=30)
    assert r.status_code == 200, r.text
    conforms(document, response_schema(document, "/v1/chat/completions", "post", 200), r.json())


def test_the_server_answers_what_the_document_says(
    server: Server, document: dict[str, Any]
) -> None:
    customer, finance = server.keys["demo-standard"], server.keys["finance"]
    base = server.base

    def get(path: str, key: str, **params: str) -> httpx.Response:
        return httpx.get(f"{base}{path}", params=params, headers=auth(key), timeout=30)

    r = httpx.post(f"{base}/v1/chat/completions", json=short_body(tokens=4),
                   headers=auth(customer), timeout=30)
    conforms(document, "ChatCompletion", r.json())
    request_id = r.headers["x-request-id"]
    server.wait_billed(request_id)

    stream = httpx.post(
        f"{base}/v1/chat/completions",
        json=short_body(tokens=4, stream=True, stream_options={"include_usage": True}),
        headers=auth(customer), timeout=30,
    )
    frames = [f[6:] for f in stream.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    for frame in frames:
        conforms(document, "ChatCompletionEvent", {"data": frame, "event": "message"})

    # The hourly usage projection folds a moment after the ledger entry.
    usage = poll("usage rows", lambda: (
        r if (r := get("/v1/billing/usage", finance, group_by="model")).json().get("data") else None
    ))
    answers = {
        "ModelList": get("/v1/models", customer),
        "UsageRow": usage,
        "LedgerEntry": get("/v1/billing/ledger", finance, limit="5"),
        "Reconciliation": get("/v1/billing/reconciliation", finance),
        "Invoice": get("/v1/billing/invoices/demo-standard", finance),
        "GoodputRow": get("/v1/billing/goodput", finance, group_by="tenant,tier,model,hour"),
        "RequestTimeline": get(f"/v1/requests/{request_id}/events", customer),
        "RequestList": get("/v1/requests", customer, limit="5"),
        "Run": httpx.post(f"{base}/v1/runs", json={"max_calls": 3, "max_cost_usd": "0.25"},
                          headers=auth(customer), timeout=30),  # fmt: skip
    }
    for name, answer in answers.items():
        assert answer.status_code == 200, answer.text
        body = answer.json()
        if isinstance(body, dict) and set(body) == {"data"}:
            assert body["data"], name
            for row in body["data"]:
                conforms(document, name, row)
        else:
            conforms(document, name, body)
        assert answer.headers["x-request-id"].startswith("req_")

    errors = [
        httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL}, headers=auth(customer)),
        httpx.post(f"{base}/v1/chat/completions", json=short_body(), headers=auth("tg_nope")),
        httpx.post(f"{base}/v1/chat/completions", json=short_body(model="nope"),
                   headers=auth(customer)),
        get("/v1/billing/ledger", finance, limit="ten"),
        get("/v1/billing/reconciliation", customer),
        get("/v1/requests/req_00000000000000000000000000000000/events", customer),
        # Were 500s (OverflowError): instants at the edge of datetime's range.
        get("/v1/billing/usage", finance, to="0001-01-01T00:00:00Z"),
        get("/v1/billing/ledger", finance, **{"from": "0001-01-01T00:00:00+23:59"}),
        httpx.post(f"{base}/v1/runs", json={"max_calls": -1}, headers=auth(customer)),
        get("/v1/runs/no-such-run", customer),
        get("/v1/requests", customer, limit="501"),
        get("/v1/requests", finance),
    ]
    assert [e.status_code for e in errors] == [
        400, 401, 404, 400, 403, 404, 400, 400, 400, 404, 400, 400
    ]
    for e in errors:
        conforms(document, "Error", e.json())


def test_per_end_user_limits_and_budgets_are_described_and_answered_as_described(
    server: Server, document: dict[str, Any]
) -> None:
    schemas = document["components"]["schemas"]
    for body in ("LimitsSet", "BudgetSet"):
        flag = schemas[body]["properties"]["per_end_user"]
        assert (flag["type"], flag["default"]) == ("boolean", False), (body, flag)
        assert "project" in flag["description"] and "end user" in flag["description"]
        assert "per_end_user" not in schemas[body].get("required", [])
    key, tenant = server.keys["admin"], f"oa-{uuid.uuid4().hex[:8]}"
    base = f"{server.base}/v1/admin/tenants"

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{base}{path}", json=body, headers=auth(key), timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json())

    post("", {"name": tenant})
    post(f"/{tenant}/workspaces", {"name": "w"})
    post(f"/{tenant}/projects", {"name": "bot", "workspace": "w"})
    each = {"project": "bot", "per_end_user": True}
    limits = post(f"/{tenant}/limits", {"model": "*", "rpm": 3, **each})
    conforms(document, response_schema(document, "/v1/admin/tenants/{tenant}/limits", "post",
                                       200), limits)  # fmt: skip
    budget = post(f"/{tenant}/budgets", {"period": "day", "amount": "2", **each})
    conforms(document, response_schema(document, "/v1/admin/tenants/{tenant}/budgets", "post",
                                       200), budget)  # fmt: skip
    assert (limits["level"], budget["level"]) == ("end_user", "end_user")
    refused = httpx.post(f"{base}/{tenant}/budgets", headers=auth(key), timeout=30,
                         json={"period": "month", "amount": "2", **each})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "period"
    conforms(document, "Error", refused.json())
