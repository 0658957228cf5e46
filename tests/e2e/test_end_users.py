"""End users (issue 30, item 6) through the running server: the official `openai` SDK names the
caller's customer with `user=` and with the X-Tollgate-End-User header (which wins); the
project's per-end-user requests/min refuses one end user and not another, with its own code;
concurrent requests of one end user never pass its daily budget; billing groups by the end
user's keyed hash; and the identifier itself is in no database file, no column and no log."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import FAST, MODEL, Server, auth, running_server
from tests.e2e.test_budgets import body, cost_of_one, make_org, post, spent, storm
from tests.e2e.test_canary import columns_containing

pytestmark = pytest.mark.e2e

CLEAR = "alice.canary-7f3e9@customer.example"  # an end user's identifier: never stored


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "end-users", [(MODEL, FAST), (MODEL, FAST)]) as s:
        s.cli("prices", "set", "--model", MODEL, "--prompt", "10", "--completion", "30",
              "--cached", "5")  # fmt: skip
        yield s


def _hash_of(server: Server, request_id: str) -> str:
    return str(server.wait_event(request_id, "RequestAdmitted").get("end_user", ""))


def test_the_sdk_names_the_end_user_and_the_header_wins(server: Server) -> None:
    org = make_org(server)
    client = OpenAI(base_url=f"{server.base}/v1", api_key=org.keys[0][1], max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    by_user = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, user=CLEAR,  # type: ignore[arg-type]
    )
    hashed = _hash_of(server, by_user.headers["x-request-id"])
    assert len(hashed) == 32 and CLEAR not in hashed
    # The header names another end user than the body's `user`: the header's is recorded.
    by_header = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, user="somebody-else",  # type: ignore[arg-type]
        extra_headers={"X-Tollgate-End-User": CLEAR},
    )
    assert _hash_of(server, by_header.headers["x-request-id"]) == hashed
    other = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, user="somebody-else",  # type: ignore[arg-type]
    )
    assert _hash_of(server, other.headers["x-request-id"]) not in ("", hashed)
    # Another tenant's "alice" is another hash (keyed per tenant).
    elsewhere = make_org(server)
    r = post(server, elsewhere.keys[0][1], body(5, user=CLEAR))
    assert r.status_code == 200, r.text
    assert _hash_of(server, r.headers["x-request-id"]) not in ("", hashed)
    # A too long identifier is a 400 naming the field.
    r = post(server, org.keys[0][1], body(5, safety_identifier="x" * 257))
    assert r.status_code == 400 and r.json()["error"]["param"] == "safety_identifier"
    r = post(server, org.keys[0][1], body(5), **{"X-Tollgate-End-User": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Tollgate-End-User"

    server.wait_all_billed()
    usage = httpx.get(
        f"{server.base}/v1/billing/usage", headers=auth(server.keys["finance"]), timeout=10,
        params={"tenant": org.tenant, "group_by": "end_user"},
    )  # fmt: skip
    assert usage.status_code == 200, usage.text
    rows = {row["end_user"]: row["requests"] for row in usage.json()["data"]}
    assert rows[hashed] == 2, rows
    assert CLEAR not in usage.text
    replay = server.cli("replay", by_header.headers["x-request-id"], "--json")
    assert hashed in replay and CLEAR not in replay
    text = server.cli("replay", by_header.headers["x-request-id"])  # support's terminal view
    assert f"end user {hashed}" in text and CLEAR not in text

    assert columns_containing(server.db_path, CLEAR) == []
    for path in [p for p in server.data_dir.rglob("*") if p.is_file()] + [server.log]:
        assert CLEAR.encode() not in path.read_bytes(), path


def test_a_per_end_user_rpm_refuses_that_end_user_only(server: Server) -> None:
    org = make_org(server)
    out = server.cli("limits", "set", "--tenant", org.tenant, "--project", org.project,
                     "--per-end-user", "--rpm", "3")  # fmt: skip
    assert "rpm 3" in out
    secret = org.keys[0][1]
    deadline = time.monotonic() + 5  # the edge follows the control plane within ~200 ms
    while time.monotonic() < deadline:
        codes = [post(server, secret, body(5, user="bob")).status_code for _ in range(4)]
        if codes[-1] == 429:
            break
    assert codes[-1] == 429
    refused = post(server, secret, body(5, user="bob"))
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "end_user_limit_exceeded" and error["param"] == "user", error
    assert "bob" not in refused.text
    assert post(server, secret, body(5, user="carol")).status_code == 200
    assert post(server, secret, body(5)).status_code == 200  # no end user: the project's only
    audit = server.cli("audit", "--tenant", org.tenant)
    assert "SetLevelLimits" in audit and "end_user search-bot" in audit, audit


def test_concurrent_requests_never_pass_an_end_users_daily_budget(server: Server) -> None:
    org = make_org(server, keys=2)
    one = cost_of_one(server, org)
    budget = 20 * one + one // 2  # about 20 of 60 requests, never a whole number of them
    server.cli("limits", "set", "--tenant", org.tenant, "--project", org.project,
               "--per-end-user", "--usd-per-day", f"{budget / 1e6:.6f}")  # fmt: skip
    time.sleep(1)  # the edge's control follower (200 ms)
    before = spent(server, org.tenant)
    codes = storm(server, [s for _, s in org.keys], 60, {"X-Tollgate-End-User": "dave"})
    assert set(codes) <= {200, 429}, codes
    server.wait_all_billed()
    total = spent(server, org.tenant) - before
    print(f"end-user budget: {codes.count(200)} of 60 admitted, {total} of {budget} micros "
          f"({100 * total / budget:.1f} %)")  # fmt: skip
    assert total <= budget, (total, budget)
    assert total >= 0.9 * budget, (total, budget, codes.count(200))
    r = post(server, org.keys[0][1], body(), **{"X-Tollgate-End-User": "dave"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "end_user_budget_exceeded"
    assert post(server, org.keys[0][1], body(), **{"X-Tollgate-End-User": "erin"}).status_code \
        == 200
    server.assert_lifecycle()
