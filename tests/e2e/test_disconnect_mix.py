"""Client disconnects over a mixed set (issue 26, item 5; RELIABILITY.md's client-disconnect row):
streams of various lengths on a fast and a slow model, and non-streamed requests, each client
leaving at a random point (after the headers, after a random number of frames, or a random
time into a JSON request), several at once. Every admitted request has one terminal and one
bill, and every cancelled one is billed exactly what the engine's own record says it processed
(prompt, cached and completion tokens): 100 % of the cancels."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL, SLOW_MODEL, Server, auth, long_body, poll
from tests.faults.tier import pick

pytestmark = pytest.mark.e2e
SEED = 2605


def _leave(server: Server, secret: str, case: dict[str, Any]) -> str:
    """Send one request and leave as `case` says; what happened, for the figures."""
    body = long_body(case["model"], case["tokens"], stream=case["stream"])
    if not case["stream"]:
        timeout = httpx.Timeout(10.0, read=case["leave_after_s"])
        try:
            httpx.post(f"{server.base}/v1/chat/completions", headers=auth(secret), json=body,
                       timeout=timeout)  # fmt: skip
        except httpx.ReadTimeout:
            return "left a JSON request"
        return "JSON answered before leaving"
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.base}/v1/chat/completions", headers=auth(secret), json=body
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        frames = 0
        for line in response.iter_lines():
            if frames >= case["leave_after_frames"]:
                return "left a stream"
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    frames += 1
    return "stream ended before leaving"


def test_every_client_cancel_over_a_mixed_set_is_billed_what_the_engine_processed(
    server: Server,
) -> None:
    rng = random.Random(SEED)
    cases = []
    for _ in range(pick(40, 300)):
        stream = rng.random() < 0.75
        cases.append({
            "model": rng.choice([MODEL, MODEL, SLOW_MODEL]),
            "tokens": rng.choice([30, 120, 600, 3000]),
            "stream": stream,
            "leave_after_frames": rng.choice([0, 1, 2, rng.randint(3, 12), rng.randint(13, 60)]),
            "leave_after_s": rng.uniform(0.05, 1.5),
        })  # fmt: skip
    tenant = server.new_tenant("disconnect-mix", plan="enterprise")
    with ThreadPoolExecutor(max_workers=6) as pool:
        outcomes = list(pool.map(lambda case: _leave(server, tenant.secret, case), cases))

    def admitted() -> list[str]:
        rows = server.query(
            "SELECT stream_id FROM events WHERE type = 'RequestAdmitted' AND tenant_id = ?",
            (tenant.name,),
        )
        return [r["stream_id"] for r in rows]

    request_ids = admitted()
    server.assert_lifecycle(request_ids, timeout=60)  # one terminal, refund, bill, ledger row
    cancelled, matched, wrong = 0, 0, []
    for request_id in request_ids:
        events = server.events(request_id)
        if not any(t == "RequestCancelled" for t, _ in events):
            continue
        cancelled += 1
        routed = next((p for t, p in events if t == "RequestRouted"), None)
        entry = server.ledger(request_id)
        assert entry is not None
        if routed is None:  # left before it reached an engine: nothing processed, nothing billed
            if (entry["prompt_tokens"], entry["completion_tokens"]) == (0, 0):
                matched += 1
            else:
                wrong.append((request_id, dict(entry), None))
            continue
        replica = server.replica(routed["replica_id"])
        record = poll(
            f"the engine's record of {request_id}",
            lambda replica=replica, rid=request_id: (
                (rec := replica.record(rid)) and rec["finished"] and rec
            ),
            timeout=15,
        )
        billed = (entry["prompt_tokens"], entry["cached_tokens"], entry["completion_tokens"])
        engine = (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"])
        if billed == engine:
            matched += 1
        else:
            wrong.append((request_id, billed, engine))
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    print(
        f"client disconnects (seed {SEED}): {len(cases)} clients {counts}; {len(request_ids)} "
        f"admitted, {cancelled} cancelled; billed = the engine's count for {matched} of "
        f"{cancelled} cancels ({100 * matched / max(1, cancelled):.1f} %)"
    )
    assert wrong == []
    assert matched == cancelled and cancelled >= len(cases) // 2
