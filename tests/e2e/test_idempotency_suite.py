"""Idempotency-Key under load (issue 14): 2,000 keys in the long tier (400 in the fast one), each
sent 5 times — a concurrent burst of
3, then 2 replays after it ended — and one body change for every tenth key. Held, per key: one
generation and one bill; every 200 byte-identical, with the first request's X-Request-Id; the
burst's others 409 (still in flight) or a replay; a different body 422. With the dedupe key
removed (the same requests without the header) the same check must find duplicates.
"""

from __future__ import annotations

import asyncio
import collections
import json
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server, auth, poll
from tests.faults.tier import pick, safeguards

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEYS = pick(400, 2_000)
BURST = 3
REPLAYS = 2
CONCURRENCY = 48


@dataclass
class KeyLog:
    bodies: list[bytes] = field(default_factory=list)  # every 200's body
    request_ids: set[str] = field(default_factory=set)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    changed_body_status: int | None = None


def _body(i: int, variant: int = 0) -> dict[str, object]:
    return {
        "model": MODEL,
        "max_tokens": 6 + variant,
        "messages": [{"role": "user", "content": f"Say hello to number {i}."}],
    }


async def _drive(
    server: Server, secret: str, prefix: str, keys: int, with_key: bool
) -> dict[int, KeyLog]:
    logs = {i: KeyLog() for i in range(keys)}
    limit = asyncio.Semaphore(CONCURRENCY)
    url = f"{server.base}/v1/chat/completions"

    async def send(client: httpx.AsyncClient, i: int, variant: int = 0) -> int:
        headers = auth(secret) | ({"Idempotency-Key": f"{prefix}-{i}"} if with_key else {})
        async with limit:
            r = await client.post(url, headers=headers, json=_body(i, variant))
        log = logs[i]
        log.statuses[r.status_code] += 1
        if r.status_code == 200:
            log.bodies.append(r.content)
            log.request_ids.add(r.headers["x-request-id"])
        return r.status_code

    async def one_key(client: httpx.AsyncClient, i: int) -> None:
        await asyncio.gather(*(send(client, i) for _ in range(BURST)))
        for _ in range(REPLAYS):
            while await send(client, i) == 409:  # the burst's first is still finishing
                await asyncio.sleep(0.05)
        if i % 10 == 0:
            logs[i].changed_body_status = await send(client, i, variant=1)

    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(one_key(client, i) for i in range(keys)))
    return logs


@pytest.mark.parametrize("safeguard", safeguards("on", "off"))
def test_two_thousand_keys_five_times_each_one_generation_and_one_bill(
    server: Server, safeguard: str
) -> None:
    tenant = server.new_tenant("idem-suite", "enterprise", rpm=1_000_000, tpm=100_000_000)
    prefix = f"suite-{tenant.name}"
    keys = KEYS if safeguard == "on" else 40  # without the header: enough to see duplicates
    logs = asyncio.run(_drive(server, tenant.secret, prefix, keys, safeguard == "on"))
    admitted = server.query(
        "SELECT stream_id FROM events WHERE type = 'RequestAdmitted' AND tenant_id = ?",
        (tenant.name,),
    )
    server.wait_all_billed(timeout=120)
    per_request = {
        r["stream_id"]: r["n"]
        for r in server.query(
            "SELECT e.stream_id, count(l.request_id) AS n FROM events e LEFT JOIN ledger_entries l"
            " ON l.request_id = e.stream_id WHERE e.type = 'RequestAdmitted' AND e.tenant_id = ?"
            " GROUP BY e.stream_id",
            (tenant.name,),
        )
    }
    lost = sum(1 for n in per_request.values() if n == 0)
    violations: list[str] = []
    duplicated = 0
    for i, log in logs.items():
        if len(log.request_ids) != 1:
            duplicated += max(0, len(log.request_ids) - 1)
            violations.append(f"key {i}: {len(log.request_ids)} requests generated")
        if len(set(log.bodies)) > 1:
            violations.append(f"key {i}: replays differ from the first answer")
        unexpected = set(log.statuses) - {200, 409, 422 if i % 10 == 0 else 200}
        if unexpected:
            violations.append(f"key {i}: statuses {dict(log.statuses)}")
        if log.changed_body_status is not None and log.changed_body_status != 422:
            violations.append(f"key {i}: a different body answered {log.changed_body_status}")
    generations = len(admitted) if safeguard == "on" else len(per_request)
    sent = sum(sum(log.statuses.values()) for log in logs.values())
    print(
        f"Idempotency-Key (safeguard {safeguard}): operations {sent} requests over {keys} keys / "
        f"faults injected {keys * (BURST - 1 + REPLAYS)} repeats, {sum(i % 10 == 0 for i in logs)} "
        f"body changes / lost {lost} / duplicated {duplicated} / invariant violations "
        f"{len(violations)}; {generations} generations, "
        f"{sum(log.statuses[409] for log in logs.values())} answered 409 in flight"
    )
    if safeguard == "off":
        assert duplicated > 0, "without the key every repeat must be a new generation"
        return
    assert lost == 0 and not violations, violations[:10]
    assert len(admitted) == KEYS and set(per_request.values()) == {1}
    # A replay is the stored answer: the first 200 of each key parses as a completion.
    first = json.loads(logs[0].bodies[0])
    assert first["object"] == "chat.completion"
    poll("nothing left in flight", lambda: not server.lifecycle_problems(list(per_request)))
