"""Finance and support over HTTP: who reads what, the shapes finance relies on, the replay of a
request, and bad input answered 4xx with the field named — never a 500."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

import httpx
import pytest

from tests.e2e.conftest import Server, auth, short_body

pytestmark = pytest.mark.e2e


def _request(server: Server, secret: str) -> str:
    r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(), headers=auth(secret),
                   timeout=30)
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    server.wait_billed(request_id)
    return request_id


def get(server: Server, path: str, secret: str, **params: str) -> httpx.Response:
    return httpx.get(f"{server.base}{path}", params=params, headers=auth(secret), timeout=30)


def test_scopes_decide_what_each_key_reads(server: Server) -> None:
    mine = server.new_tenant("bill-a")
    other = server.new_tenant("bill-b")
    rid_mine = _request(server, mine.secret)
    rid_other = _request(server, other.secret)
    finance, support = server.keys["finance"], server.keys["support"]

    everyone = get(server, "/v1/billing/usage", finance, group_by="model").json()["data"]
    assert {mine.name, other.name} <= {row["tenant"] for row in everyone}
    own = get(server, "/v1/billing/usage", mine.secret, group_by="model").json()["data"]
    assert {row["tenant"] for row in own} == {mine.name}
    assert own[0]["requests"] == 1
    for field in ("tenant", "model", "period_start", "requests", "prompt_tokens",
                  "completion_tokens", "cached_tokens", "amount_micros", "currency"):
        assert field in own[0]
    assert own[0]["currency"] == "USD"  # the demo server's prices, under the default setting
    assert get(server, "/v1/billing/usage", mine.secret, tenant=other.name).status_code == 403
    assert get(server, "/v1/billing/usage", support).status_code == 403

    # Support reads any request; a customer its own; another tenant's id is a plain 404.
    assert get(server, f"/v1/requests/{rid_other}/events", support).status_code == 200
    assert get(server, f"/v1/requests/{rid_mine}/events", mine.secret).status_code == 200
    foreign = get(server, f"/v1/requests/{rid_other}/events", mine.secret)
    unknown = get(server, f"/v1/requests/req_{'0' * 32}/events", mine.secret)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"]
    assert get(server, f"/v1/requests/{rid_mine}/events", finance).status_code == 403


def test_ledger_csv_invoice_and_replay_agree(server: Server) -> None:
    tenant = server.new_tenant("bill-c")
    request_id = _request(server, tenant.secret)
    finance = server.keys["finance"]

    r = get(server, "/v1/billing/ledger", finance, tenant=tenant.name, format="csv")
    assert r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [row["request_id"] for row in rows] == [request_id]
    entry = server.wait_billed(request_id)
    assert int(rows[0]["amount_micros"]) == entry["amount_micros"]
    assert rows[0]["terminal_reason"] == "completed"
    assert rows[0]["currency"] == entry["currency"] == "USD"

    period = datetime.now(UTC).strftime("%Y-%m")
    invoice = get(server, f"/v1/billing/invoices/{tenant.name}", finance, period=period).json()
    assert invoice["amount_micros"] == entry["amount_micros"] and invoice["requests"] == 1
    assert invoice["currency"] == "USD" and [t["currency"] for t in invoice["totals"]] == ["USD"]
    assert [line["currency"] for line in invoice["lines"]] == ["USD"]

    timeline = get(server, f"/v1/requests/{request_id}/events", server.keys["support"]).json()
    types = [e["type"] for e in timeline["events"]]
    assert types[:3] == ["RequestAdmitted", "RequestEstimated", "RequestRouted"]
    assert "RequestCompleted" in types and types[-1] == "UsageBilled"
    assert timeline["plan_at_admission"] == "standard"
    assert timeline["limits_at_admission"]["rpm"] > 0
    assert timeline["billing"]["amount_micros"] == entry["amount_micros"]
    assert timeline["anomalies"] == []
    assert timeline["quota"]["refunded_tokens"] == (
        timeline["quota"]["reserved_tokens"] - timeline["quota"]["used_tokens"]
    )
    # The CLI re-folds the same events.
    out = server.cli("replay", request_id)
    assert request_id in out and "RequestCompleted" in out and "ANOMALY" not in out

    report = get(server, "/v1/billing/reconciliation", finance).json()
    assert report["ok"], report["mismatches"]


@pytest.mark.parametrize(
    ("path", "params", "status", "param"),
    [
        ("/v1/billing/usage", {"from": "yesterday"}, 400, "from"),
        ("/v1/billing/usage", {"from": "2026-11-02T00:00:00Z", "to": "2026-11-01T00:00:00Z"},
         400, "from"),
        ("/v1/billing/usage", {"from": "2020-01-01T00:00:00Z", "to": "2026-01-01T00:00:00Z"},
         400, "to"),
        ("/v1/billing/usage", {"group_by": "week"}, 400, "group_by"),
        ("/v1/billing/usage", {"format": "xml"}, 400, "format"),
        ("/v1/billing/usage", {"tenant": "no-such-tenant"}, 404, "tenant"),
        ("/v1/billing/ledger", {"limit": "many"}, 400, "limit"),
        ("/v1/billing/ledger", {"limit": "0"}, 400, "limit"),
        ("/v1/billing/invoices/no-such-tenant", {}, 404, "tenant"),
        ("/v1/billing/invoices/demo-standard", {"period": "2026-13"}, 400, "period"),
        ("/v1/requests/not-an-id/events", {}, 400, "request_id"),
    ],
)
def test_bad_queries_name_the_field(
    server: Server, path: str, params: dict[str, str], status: int, param: str
) -> None:
    secret = server.keys["support"] if path.startswith("/v1/requests") else server.keys["finance"]
    r = get(server, path, secret, **params)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
