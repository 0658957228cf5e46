"""Hierarchical budgets and agent runs through the running server, over real HTTP: a project
budget refused with the level named (and replayed), run budgets by calls, in flight, tool calls,
and their API; then 200 concurrent requests from several processes against a budget that admits
about half, and the same for a run's max cost and max calls: committed spend never passes a
budget and uses at least 90 % of it.

Its own server: its prices are set for the test (every request costs in whole micro-dollars)."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server

pytestmark = pytest.mark.e2e

PROMPT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "budgets", [(MODEL, FAST), (MODEL, FAST)]) as s:
        # $10 / $30 per million prompt / completion tokens: a short request costs ~1 milli-dollar.
        s.cli("prices", "set", "--model", MODEL, "--prompt", "10", "--completion", "30",
              "--cached", "5")  # fmt: skip
        yield s


@dataclass
class Org:
    tenant: str
    workspace: str
    project: str
    keys: list[tuple[str, str]]  # (key id, secret)


def make_org(server: Server, keys: int = 1) -> Org:
    tenant = f"bud-{uuid.uuid4().hex[:8]}"
    server.cli("tenants", "create", tenant, "--plan", "enterprise")
    server.cli("workspaces", "create", "research", "--tenant", tenant)
    server.cli("projects", "create", "search-bot", "--tenant", tenant, "--workspace", "research")
    issued = []
    for _ in range(keys):
        out = server.cli("keys", "issue", "--tenant", tenant, "--project", "search-bot")
        lines = out.strip().splitlines()
        issued.append((lines[0].split(" key ")[1].split()[0], lines[-1].strip()))
    for _, secret in issued:
        server.wait_key(secret)
    return Org(tenant, "research", "search-bot", issued)


def body(max_tokens: int = 20, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPT}], **kw}  # fmt: skip


def post(server: Server, secret: str, payload: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/chat/completions", json=payload, timeout=60,
                      headers={**auth(secret), **headers})  # fmt: skip


def cost_of_one(server: Server, org: Org) -> int:
    """The exact cost of `body()` (ignore_eos: every reserved token is produced, and the
    simulator's prompt count is the estimator's), as its reservation recorded it."""
    r = post(server, org.keys[0][1], body())
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    reserved = server.wait_event(rid, "BudgetReserved")["reserved_micros"]
    assert server.wait_billed(rid)["amount_micros"] == reserved
    return int(reserved)


def spent(server: Server, tenant: str) -> int:
    server.wait_all_billed()
    rows = server.query(
        "SELECT coalesce(sum(amount_micros), 0) AS s FROM ledger_entries WHERE tenant_id = ?",
        (tenant,),
    )
    return int(rows[0]["s"])


def wait_budget(server: Server, org: Org, check: Any) -> None:
    """The control follower applies a change within 200 ms: poll the edge's answer."""
    poll("the budget change at the edge", check, timeout=5, every=0.05)


# --- one at a time ------------------------------------------------------------------------------


def test_a_project_budget_refuses_naming_the_level_and_replay_shows_why(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    server.cli("budgets", "set", "--tenant", org.tenant, "--period", "month", "--usd", "100")
    one = cost_of_one(server, org)
    budget = 4 * one  # the first, then three more
    server.cli("budgets", "set", "--tenant", org.tenant, "--project", org.project,
               "--period", "month", "--usd", f"{budget / 1e6:.6f}")  # fmt: skip
    statuses = []
    for _ in range(5):
        r = post(server, secret, body())
        statuses.append(r.status_code)
        if r.status_code == 429:
            break
    assert statuses == [200, 200, 200, 429], statuses
    error = r.json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "budget"
    assert 'project "search-bot"' in error["message"] and org.tenant not in error["message"]
    assert int(r.headers["retry-after"]) >= 5
    # Later requests hit the prefix cache (cheaper than reserved): what was spent is within the
    # budget, and the refused request's maximum cost would have passed it.
    total = spent(server, org.tenant)
    assert total <= budget < total + one
    replay = httpx.get(f"{server.base}/v1/requests/{r.headers['x-request-id']}/events",
                       headers=auth(secret), timeout=10).json()  # fmt: skip
    assert replay["rejection"]["reason"] == "budget"
    assert 'project "search-bot"' in replay["rejection"]["detail"]
    assert "spent" in replay["rejection"]["detail"]


def test_lowering_a_workspace_budget_is_in_force_within_a_second(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    assert post(server, secret, body()).status_code == 200
    server.cli("budgets", "set", "--tenant", org.tenant, "--workspace", org.workspace,
               "--period", "day", "--usd", "0.000001")  # fmt: skip

    def refused() -> bool:
        r = post(server, secret, body())
        return r.status_code in (400, 429)

    # Refused within a second of the command's return (the follower polls every 200 ms).
    poll("the lowered workspace budget", refused, timeout=1.0, every=0.05)


def test_a_revoked_project_key_is_refused_within_a_second(server: Server) -> None:
    org = make_org(server, keys=2)
    (key_a, secret_a), (_, secret_b) = org.keys
    assert post(server, secret_a, body()).status_code == 200
    server.cli("keys", "revoke", key_a, "--tenant", org.tenant)
    poll("the revoked key", lambda: post(server, secret_a, body()).status_code == 401,
         timeout=1.0, every=0.05)  # fmt: skip
    assert post(server, secret_b, body()).status_code == 200


def test_a_run_created_by_the_api_stops_at_its_max_calls(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    created = httpx.post(f"{server.base}/v1/runs", headers=auth(secret), timeout=10,
                         json={"id": "agent-task-1", "max_calls": 2, "max_cost_usd": "1"})
    assert created.status_code == 200, created.text
    run = created.json()
    assert (run["project"], run["status"], run["limits"]["max_calls"]) == (
        "search-bot", "active", 2,
    )  # fmt: skip
    hdr = {"X-Tollgate-Run-Id": "agent-task-1"}
    codes = [post(server, secret, body(), **hdr).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = post(server, secret, body(), **hdr)
    assert r.json()["error"]["code"] == "run_budget_exceeded"
    assert "model calls" in r.json()["error"]["message"]
    shown = httpx.get(f"{server.base}/v1/runs/agent-task-1", headers=auth(secret), timeout=10)
    usage = shown.json()["usage"]
    assert (usage["calls"], usage["in_flight"], shown.json()["exhausted"]) == (2, 0, "calls")
    assert float(usage["cost_usd"]) > 0
    ended = httpx.post(f"{server.base}/v1/runs/agent-task-1/end", headers=auth(secret),
                       timeout=10)  # fmt: skip
    assert ended.json()["status"] == "ended" and ended.json()["ended_at"]
    # Another tenant cannot see it.
    other = make_org(server)
    assert httpx.get(f"{server.base}/v1/runs/agent-task-1", headers=auth(other.keys[0][1]),
                     timeout=10).status_code == 404  # fmt: skip
    # Its events: the start, the exhaustion, the end.
    types = [r["type"] for r in server.query(
        "SELECT type FROM events WHERE stream_id = ? ORDER BY stream_version",
        (f"run-{org.tenant}-agent-task-1",))]  # fmt: skip
    assert types == ["RunStarted", "RunBudgetExhausted", "RunEnded"]


def test_an_unknown_run_id_starts_a_run_under_the_projects_policy(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    server.cli("runs", "policy", "--tenant", org.tenant, "--project", org.project,
               "--max-calls", "1")  # fmt: skip
    # The first call may reach the edge before the policy does (it follows the control plane
    # within half a second): the run it starts is bound by the policy in force at its start all
    # the same, and the calls admitted meanwhile count against it.
    run_id = "implicit-1"
    hdr = {"X-Tollgate-Run-Id": run_id}
    assert post(server, secret, body(), **hdr).status_code == 200
    calls = 1

    def refused() -> bool:
        nonlocal calls
        status = post(server, secret, body(), **hdr).status_code
        calls += status == 200
        return status == 429

    poll("the run policy at the edge", refused, timeout=10, every=0.1)
    run = httpx.get(f"{server.base}/v1/runs/{run_id}", headers=auth(secret), timeout=10).json()
    assert run["implicit"] and run["limits"]["max_calls"] == 1 and run["usage"]["calls"] == calls
    bad = post(server, secret, body(), **{"X-Tollgate-Run-Id": "no spaces"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Tollgate-Run-Id"


def test_a_run_counts_the_tool_calls_the_engine_returned(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    httpx.post(f"{server.base}/v1/runs", headers=auth(secret), timeout=10,
               json={"id": "tools-1", "max_tool_calls": 1}).raise_for_status()  # fmt: skip
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    hdr = {"X-Tollgate-Run-Id": "tools-1"}
    calls = None
    for _ in range(10):  # a generation that stops on its own calls the tool
        r = post(server, secret, {"model": MODEL, "max_tokens": 2000, "tools": tools,
                                  "messages": [{"role": "user", "content": PROMPT}]}, **hdr)
        if r.status_code == 429:
            break
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"].get("tool_calls")
        if calls:
            assert calls[0]["function"]["name"] == "search"
    assert calls, "the simulated replica returned no tool call"
    refused = post(server, secret, body(), **hdr)
    assert refused.status_code == 429
    assert "tool calls" in refused.json()["error"]["message"]
    run = httpx.get(f"{server.base}/v1/runs/tools-1", headers=auth(secret), timeout=10).json()
    assert run["usage"]["tool_calls"] == 1


# --- under concurrency ----------------------------------------------------------------------------


def _client(args: tuple[str, str, list[tuple[int, str]], dict[str, str]]) -> list[int]:
    """One client process: its requests over 8 threads; `(i, kind)` kinds are json, stream
    and cancel (a stream closed after its first chunk)."""
    base, secret, plan, headers = args

    def one(item: tuple[int, str]) -> int:
        _, kind = item
        payload = body(stream=kind != "json")
        with httpx.Client(timeout=60) as client:
            if kind == "json":
                return client.post(f"{base}/v1/chat/completions", json=payload,
                                   headers={**auth(secret), **headers}).status_code  # fmt: skip
            with client.stream("POST", f"{base}/v1/chat/completions", json=payload,
                               headers={**auth(secret), **headers}) as r:  # fmt: skip
                if r.status_code != 200 or kind == "cancel":
                    return r.status_code
                for _ in r.iter_lines():
                    pass
                return r.status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, plan))


def storm(server: Server, secrets: list[str], n: int, headers: dict[str, str]) -> list[int]:
    """`n` requests from 4 processes, about a tenth streamed, a few cancelled."""
    kinds = ["cancel" if i % 40 == 7 else "stream" if i % 10 == 3 else "json" for i in range(n)]
    plans = [[(i, kinds[i]) for i in range(p, n, 4)] for p in range(4)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(
            _client, [(server.base, secrets[p % len(secrets)], plans[p], headers) for p in range(4)]
        )
    return [code for codes in results for code in codes]


def test_200_concurrent_requests_never_pass_a_project_budget(server: Server) -> None:
    org = make_org(server, keys=2)
    one = cost_of_one(server, org)
    budget = 100 * one + one // 2  # about half of 200, and never a whole number of requests
    # Each budget counts the first request too (it is this month's): `+ one`.
    for flags in (["--project", org.project], ["--workspace", org.workspace], []):
        amount = budget if flags[:1] == ["--project"] else 10 * budget
        server.cli("budgets", "set", "--tenant", org.tenant, *flags, "--period", "month",
                   "--usd", f"{(amount + one) / 1e6:.6f}")  # fmt: skip
    codes = storm(server, [s for _, s in org.keys], 200, {})
    assert set(codes) <= {200, 429}, codes
    total = spent(server, org.tenant) - one
    print(f"project budget: {codes.count(200)} of 200 admitted, {total} of {budget} micros "
          f"spent ({100 * total / budget:.1f} %)")  # fmt: skip
    assert total <= budget, (total, budget)
    assert total >= 0.9 * budget, (total, budget, codes.count(200))
    server.assert_lifecycle()
    per_key = server.query(
        "SELECT key_id, sum(amount_micros) AS s FROM ledger_entries WHERE tenant_id = ? "
        "GROUP BY key_id", (org.tenant,),
    )  # fmt: skip
    assert sum(int(r["s"]) for r in per_key) == total + one


def test_concurrent_calls_of_a_run_never_pass_its_max_cost_or_max_calls(server: Server) -> None:
    org = make_org(server)
    secret = org.keys[0][1]
    one = cost_of_one(server, org)
    max_cost = 20 * one + one // 2
    for run_id, limits in (("cost-run", {"max_cost_usd": f"{max_cost / 1e6:.6f}"}),
                           ("calls-run", {"max_calls": 30})):  # fmt: skip
        httpx.post(f"{server.base}/v1/runs", headers=auth(secret), timeout=10,
                   json={"id": run_id, **limits}).raise_for_status()  # fmt: skip
    codes = storm(server, [secret], 80, {"X-Tollgate-Run-Id": "cost-run"})
    assert set(codes) <= {200, 429}
    server.wait_all_billed()
    run = httpx.get(f"{server.base}/v1/runs/cost-run", headers=auth(secret), timeout=10).json()
    posted = round(float(run["usage"]["cost_usd"]) * 1e6)
    print(f"run max cost: {codes.count(200)} of 80 admitted, {posted} of {max_cost} micros "
          f"({100 * posted / max_cost:.1f} %)")  # fmt: skip
    assert posted <= max_cost and posted >= 0.9 * max_cost, (posted, max_cost)
    assert run["usage"]["reserved_usd"] == "0"
    codes = storm(server, [secret], 80, {"X-Tollgate-Run-Id": "calls-run"})
    assert codes.count(200) == 30, codes
    run = httpx.get(f"{server.base}/v1/runs/calls-run", headers=auth(secret), timeout=10).json()
    assert run["usage"]["calls"] == 30 and run["exhausted"] == "calls"
    server.assert_lifecycle()


# --- finance by level -------------------------------------------------------------------------


def test_usage_and_the_ledger_group_by_workspace_project_and_run(server: Server) -> None:
    org = make_org(server)
    project_secret = org.keys[0][1]
    out = server.cli("keys", "issue", "--tenant", org.tenant).strip().splitlines()
    org_secret = out[-1].strip()
    server.wait_key(org_secret)
    in_run = {"X-Tollgate-Run-Id": "r-fin"}
    for _ in range(2):
        assert post(server, project_secret, body(), **in_run).status_code == 200
    assert post(server, org_secret, body()).status_code == 200
    server.wait_all_billed()
    spent_total = spent(server, org.tenant)

    def usage(group_by: str, fmt: str = "json") -> httpx.Response:
        return httpx.get(f"{server.base}/v1/billing/usage", headers=auth(project_secret),
                         params={"group_by": group_by, "format": fmt}, timeout=10)  # fmt: skip

    by_project = {r["project_id"]: r for r in usage("project").json()["data"]}
    assert set(by_project) == {"search-bot", None}
    assert (by_project["search-bot"]["requests"], by_project[None]["requests"]) == (2, 1)
    assert sum(r["amount_micros"] for r in by_project.values()) == spent_total
    by_run = {r["run_id"]: r["requests"] for r in usage("run").json()["data"]}
    assert by_run == {"r-fin": 2, None: 1}
    workspaces = {r["workspace_id"] for r in usage("workspace").json()["data"]}
    assert workspaces == {"research", None}
    csv = usage("project", "csv").text.splitlines()
    assert csv[0].endswith(",project_id") and any(line.endswith(",search-bot") for line in csv)
    entries = httpx.get(f"{server.base}/v1/billing/ledger", headers=auth(project_secret),
                        timeout=10).json()["data"]  # fmt: skip
    assert sorted(str(e["run_id"]) for e in entries) == ["None", "r-fin", "r-fin"]
    cli = server.cli("ledger", "usage", "--tenant", org.tenant, "--group-by", "project",
                     "--format", "csv")  # fmt: skip
    assert "search-bot" in cli
    view = server.query(
        "SELECT project_id, requests, amount_micros FROM finance_spend_by_level "
        "WHERE tenant_id = ? ORDER BY project_id", (org.tenant,),
    )  # fmt: skip
    assert [(r["project_id"], r["requests"]) for r in view] == [(None, 1), ("search-bot", 2)]
    # The finance page shows the tree with each level's spend against its budget.
    server.cli("budgets", "set", "--tenant", org.tenant, "--project", org.project,
               "--period", "month", "--usd", "1")  # fmt: skip
    with httpx.Client(base_url=server.base, timeout=10) as browser:
        signed_in = browser.post("/ui/login", data={"key": server.keys["finance"]})
        assert signed_in.status_code == 303, signed_in.text
        page = poll("the budget on the finance page", lambda: (
            r if "1.00" in (r := browser.get("/ui/finance", params={"tenant": org.tenant})).text
            else None
        ), timeout=5)  # fmt: skip
    assert page.status_code == 200 and 'id="spend-tree"' in page.text
    for level, name in (("workspace", "research"), ("project", "search-bot")):
        assert f'data-level="{level}" data-name="{name}"' in page.text
