"""A mixed run: over a thousand requests from the three demo tenants, streamed and not, some
clients leaving mid-stream, some engine failures, 32 at a time. Afterwards the ledger's totals
equal the engines' own totals, one entry per admitted request, every request ended once."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server, auth, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = 1_050
CONCURRENCY = 32
TENANTS = ("demo-free", "demo-standard", "demo-enterprise")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    fast = {"speed": 20, "step_base_ms": 10, "mean_output_tokens": 24}
    with running_server(tmp_path_factory, "mixed", [(MODEL, fast), (MODEL, fast)]) as server:
        # The free plan's 20 requests/min would turn most of its share into 429s: lift it so the
        # run bills all three tiers (a refusal is never billed, so the checks hold either way).
        server.cli("limits", "set", "--tenant", "demo-free", "--model", "*", "--rpm", "100000",
                   "--tpm", "100000000")
        server.cli("limits", "set", "--tenant", "demo-standard", "--model", "*", "--rpm",
                   "100000", "--tpm", "100000000")
        yield server


async def one(client: httpx.AsyncClient, server: Server, i: int, rng: random.Random) -> tuple:
    tenant = TENANTS[i % 3]
    kind = ("json", "json", "json", "stream", "stream", "stream_no_usage", "disconnect",
            "fail_stream", "fail_json", "stream")[i % 10]
    body: dict = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i} " + "hello " * rng.randint(1, 40)}],
        "max_tokens": rng.randint(1, 48),
    }
    if kind in ("stream", "disconnect", "fail_stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if kind == "stream_no_usage":
        body["stream"] = True
    if kind == "disconnect":
        body.update(max_tokens=400, ignore_eos=True)
    if kind.startswith("fail"):
        body.update(max_tokens=30, ignore_eos=True, sim_fail_after_tokens=rng.randint(1, 10))
    url = f"{server.base}/v1/chat/completions"
    headers = auth(server.keys[tenant])
    if kind == "disconnect":
        async with client.stream("POST", url, headers=headers, json=body) as r:
            rid = r.headers.get("x-request-id")
            if r.status_code != 200:
                await r.aread()
                return kind, r.status_code, rid
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen >= 3:
                        break
        return kind, 499, rid
    r = await client.post(url, headers=headers, json=body)
    if kind.startswith("fail") or r.status_code != 200:
        return kind, r.status_code, r.headers.get("x-request-id")
    if body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
        if kind == "stream":
            usage = json.loads([f for f in r.text.split("\n\n") if f][-2][6:])["usage"]
            assert usage["completion_tokens"] <= body["max_tokens"]
    else:
        assert r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
    return kind, r.status_code, r.headers.get("x-request-id")


async def run_all(server: Server) -> list[tuple]:
    rng = random.Random(20261129)
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def guarded(i: int) -> tuple:
            async with sem:
                return await one(client, server, i, rng)

        return await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))


def test_mixed_run_bills_exactly_what_the_engines_generated(fleet: Server) -> None:
    server = fleet
    results = asyncio.run(run_all(server))
    statuses = Counter((kind, status) for kind, status, _ in results)
    ok = sum(n for (_, status), n in statuses.items() if status in (200, 499, 502))
    assert ok >= REQUESTS * 0.9, statuses
    assert all(status in (200, 429, 499, 502, 503) for _, status, _ in results), statuses
    assert statuses[("fail_json", 502)] > 0 and statuses[("disconnect", 499)] > 0, statuses

    server.wait_all_billed(timeout=90)
    server.assert_lifecycle(timeout=30)

    admitted = server.query("SELECT count(*) AS n FROM events WHERE type = 'RequestAdmitted'")
    entries = server.query("SELECT count(*) AS n FROM ledger_entries")
    assert entries[0]["n"] == admitted[0]["n"] >= REQUESTS * 0.9

    ledger = server.query(
        "SELECT sum(prompt_tokens) AS p, sum(completion_tokens) AS c, sum(cached_tokens) AS k, "
        "count(*) AS n FROM ledger_entries"
    )[0]
    stats = [r.stats() for r in server.replicas]
    assert all(s["running"] == 0 and s["waiting"] == 0 for s in stats), stats
    engine = {k: sum(s[k] for s in stats) for k in ("prompt_tokens", "completion_tokens",
                                                    "cached_tokens", "requests")}
    assert engine["requests"] == ledger["n"], (engine, dict(ledger))
    assert (ledger["p"], ledger["k"]) == (engine["prompt_tokens"], engine["cached_tokens"]), (
        dict(ledger), engine,
    )
    # Completion tokens: exact for every request, cancelled ones included (the edge aborts by
    # half-closing the engine connection and bills what the engine had sent).
    assert ledger["c"] == engine["completion_tokens"], (dict(ledger), engine)
    cancelled = server.query(
        "SELECT request_id, completion_tokens FROM ledger_entries WHERE terminal = 'cancelled'"
    )
    assert cancelled, "the mix was meant to include client disconnects"
    for row in cancelled:
        record = next(rec for r in server.replicas if (rec := r.record(row["request_id"])))
        assert record["completion_tokens"] == row["completion_tokens"], (record, dict(row))
