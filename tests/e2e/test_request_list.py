"""Support finds a tenant's recent requests (GET /v1/requests, the support page's list, and
`tollgate requests list`): newest first, filtered by time, status, key and model, paged, bounded,
and never across tenants."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server, Tenant, auth, poll, short_body

pytestmark = pytest.mark.e2e

ROW_FIELDS = {"request_id", "status", "model", "tier", "key_id", "admitted_at", "finished_at",
              "tokens", "reject_reason", "replica", "refusals", "region", "retention",
              "adapter"}  # fmt: skip


def get(server: Server, path: str, secret: str, **params: str) -> httpx.Response:
    return httpx.get(f"{server.base}{path}", params=params, headers=auth(secret), timeout=30)


def send(server: Server, secret: str) -> str:
    r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(tokens=4),
                   headers=auth(secret), timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return str(r.headers["x-request-id"])


def second_key(server: Server, tenant: Tenant) -> tuple[str, str]:
    out = server.cli("keys", "issue", "--tenant", tenant.name).strip().splitlines()
    secret, key_id = out[-1].strip(), out[0].split(" key ")[1].split()[0]
    server.wait_key(secret)
    return key_id, secret


def listed(server: Server, secret: str, **params: str) -> dict[str, Any]:
    r = get(server, "/v1/requests", secret, **params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def ids(page: dict[str, Any]) -> list[str]:
    return [row["request_id"] for row in page["data"]]


@pytest.fixture(scope="module")
def traffic(server: Server) -> dict[str, Any]:
    """Tenant A: four requests from its first key, then two from a second key; tenant B: one.
    Returns once the request log holds every one of them, ended."""
    a, b = server.new_tenant("reqlist-a"), server.new_tenant("reqlist-b")
    other_key, other_secret = second_key(server, a)
    sent = [send(server, a.secret) for _ in range(4)] + [send(server, other_secret) for _ in
                                                         range(2)]  # fmt: skip
    foreign = send(server, b.secret)
    support = server.keys["support"]

    def logged() -> bool:
        page = listed(server, support, tenant=a.name, status="completed")
        theirs = listed(server, support, tenant=b.name, status="completed")
        return len(page["data"]) == len(sent) and ids(theirs) == [foreign]

    poll("the request log to hold every request, completed", logged, timeout=30)
    return {"a": a, "b": b, "sent": sent, "foreign": foreign, "other_key": other_key}


def test_support_lists_a_tenants_requests_newest_first_without_content(
    server: Server, traffic: dict[str, Any]
) -> None:
    a: Tenant = traffic["a"]
    page = listed(server, server.keys["support"], tenant=a.name)
    assert page["object"] == "list" and page["tenant"] == a.name
    assert ids(page) == list(reversed(traffic["sent"]))
    assert page["has_more"] is False and page["last_id"] == traffic["sent"][0]
    admitted = [row["admitted_at"] for row in page["data"]]
    assert admitted == sorted(admitted, reverse=True)
    for row in page["data"]:
        assert set(row) == ROW_FIELDS
        assert row["status"] == "completed" and row["model"].startswith(MODEL)
        assert row["finished_at"] >= row["admitted_at"] and row["replica"]
        assert row["tokens"]["completion_tokens"] == 4 and row["tokens"]["prompt_tokens"] > 0
        assert row["reject_reason"] is None
    # No prompt or completion text: the request log holds none, and the answer carries none.
    assert "Hello there" not in json.dumps(page)
    # A finance key reads it too, naming the tenant.
    assert ids(listed(server, server.keys["finance"], tenant=a.name)) == ids(page)


def test_filters_by_key_status_model_and_time(server: Server, traffic: dict[str, Any]) -> None:
    a: Tenant = traffic["a"]
    support = server.keys["support"]
    sent = traffic["sent"]
    every = listed(server, support, tenant=a.name)["data"]

    by_key = listed(server, support, tenant=a.name, key_id=traffic["other_key"])
    assert ids(by_key) == list(reversed(sent[4:]))
    assert {row["key_id"] for row in by_key["data"]} == {traffic["other_key"]}
    assert ids(listed(server, support, tenant=a.name, key_id=a.key_id)) == list(
        reversed(sent[:4])
    )
    assert ids(listed(server, support, tenant=a.name, status="completed")) == ids(
        {"data": every}
    )
    assert listed(server, support, tenant=a.name, status="rejected")["data"] == []
    assert ids(listed(server, support, tenant=a.name, model=MODEL)) == ids({"data": every})
    assert listed(server, support, tenant=a.name, model="no-such-model")["data"] == []

    # [from, to): from the third newest's admission on, and everything before it.
    pivot = every[2]["admitted_at"]
    assert ids(listed(server, support, tenant=a.name, **{"from": pivot})) == ids(
        {"data": every[:3]}
    )
    assert ids(listed(server, support, tenant=a.name, to=pivot)) == ids({"data": every[3:]})


def test_pages_follow_each_other_without_gaps_or_repeats(
    server: Server, traffic: dict[str, Any]
) -> None:
    a: Tenant = traffic["a"]
    support = server.keys["support"]
    seen: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        params = {"tenant": a.name, "limit": "4"} | ({"after": after} if after else {})
        page = listed(server, support, **params)
        pages += 1
        seen += ids(page)
        assert len(page["data"]) <= 4
        if not page["has_more"]:
            break
        after = page["last_id"]
        assert after == seen[-1]
    assert pages == 2 and seen == list(reversed(traffic["sent"]))
    # Exactly a page's worth says there is no more only when there is none.
    assert listed(server, support, tenant=a.name, limit="6")["has_more"] is False
    assert listed(server, support, tenant=a.name, limit="5")["has_more"] is True


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "501"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"status": "done"}, "status"),
        ({"from": "yesterday"}, "from"),
        ({"after": "req_" + "0" * 32}, "after"),
        ({"key_id": "a\x00b"}, "key_id"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(
    server: Server, traffic: dict[str, Any], params: dict[str, str], param: str
) -> None:
    r = get(server, "/v1/requests", server.keys["support"], tenant=traffic["a"].name, **params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert r.headers["x-request-id"].startswith("req_")


def test_the_limit_bounds_are_inclusive(server: Server, traffic: dict[str, Any]) -> None:
    support = server.keys["support"]
    assert len(listed(server, support, tenant=traffic["a"].name, limit="1")["data"]) == 1
    assert len(listed(server, support, tenant=traffic["a"].name, limit="500")["data"]) == 6


def test_a_customer_sees_only_its_own_tenant(server: Server, traffic: dict[str, Any]) -> None:
    a, b = traffic["a"], traffic["b"]
    own = listed(server, b.secret)
    assert own["tenant"] == b.name and ids(own) == [traffic["foreign"]]
    assert ids(listed(server, b.secret, tenant=b.name)) == ids(own)

    # Another tenant answers exactly like an unknown one: nothing tells the two apart.
    foreign = get(server, "/v1/requests", b.secret, tenant=a.name)
    unknown = get(server, "/v1/requests", b.secret, tenant="no-such-tenant")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"] == unknown.json()["error"] | {
        "message": unknown.json()["error"]["message"].replace("no-such-tenant", a.name)
    }
    assert foreign.json()["error"]["code"] == "tenant_not_found"
    # A customer cannot page into another tenant's rows by naming one of its request ids.
    r = get(server, "/v1/requests", b.secret, after=traffic["sent"][0])
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


def test_support_must_name_a_tenant_and_it_must_exist(
    server: Server, traffic: dict[str, Any]
) -> None:
    support = server.keys["support"]
    r = get(server, "/v1/requests", support)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant", r.text
    r = get(server, "/v1/requests", support, tenant="no-such-tenant")
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found", r.text
    assert get(server, "/v1/requests", "tg_not-a-key", tenant=traffic["a"].name).status_code == 401


def test_the_support_page_lists_requests_linking_to_their_timelines(
    server: Server, traffic: dict[str, Any]
) -> None:
    a, b = traffic["a"], traffic["b"]
    support = server.keys["support"]

    def page(secret: str, **params: str) -> httpx.Response:
        return httpx.get(f"{server.base}/ui/support", params=params, headers=auth(secret),
                         timeout=30)  # fmt: skip

    r = page(support, list="1", tenant=a.name, key_id=traffic["other_key"], status="completed",
             **{"from": "", "to": ""})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.text.count('class="request-row"') == 2
    for request_id in traffic["sent"][4:]:
        assert f'href="/ui/support?request_id={request_id}"' in r.text
    assert traffic["sent"][0] not in r.text and traffic["foreign"] not in r.text

    # A page of two has a link to the older ones, and that link's page holds the rest.
    r = page(support, list="1", tenant=a.name, limit="2")
    assert r.text.count('class="request-row"') == 2 and 'id="next-page"' in r.text
    following = r.text.split('id="next-page" href="')[1].split('"')[0].replace("&amp;", "&")
    assert "after=" in following and f"tenant={a.name}" in following
    r = httpx.get(f"{server.base}{following}", headers=auth(support), timeout=30)
    assert r.status_code == 200 and traffic["sent"][3] in r.text
    assert traffic["sent"][5] not in r.text

    # The link opens the request's timeline.
    r = page(support, request_id=traffic["sent"][0])
    assert r.status_code == 200 and 'id="request-id"' in r.text

    # A customer sees its own tenant's requests by default, and not another's when it asks.
    r = page(b.secret)
    assert r.status_code == 200 and f"/ui/support?request_id={traffic['foreign']}" in r.text
    assert not any(request_id in r.text for request_id in traffic["sent"])
    r = page(b.secret, list="1", tenant=a.name)
    assert r.status_code == 404 and 'id="requests-error"' in r.text
    assert not any(request_id in r.text for request_id in traffic["sent"])

    # Support without a tenant: the form's error, named.
    r = page(support, list="1")
    assert r.status_code == 400 and 'id="requests-error"' in r.text and "tenant" in r.text


def test_the_cli_lists_what_the_api_does(server: Server, traffic: dict[str, Any]) -> None:
    a: Tenant = traffic["a"]
    out = json.loads(server.cli("requests", "list", "--tenant", a.name, "--format", "json"))
    assert ids(out) == list(reversed(traffic["sent"]))
    out = json.loads(server.cli("requests", "list", "--tenant", a.name, "--key",
                                traffic["other_key"], "--since", "1d", "--limit", "1",
                                "--format", "json"))  # fmt: skip
    assert ids(out) == [traffic["sent"][5]] and out["has_more"] is True
    table = server.cli("requests", "list", "--tenant", a.name, "--status", "completed")
    assert all(request_id in table for request_id in traffic["sent"])
    assert traffic["foreign"] not in table
