"""Replay determinism (issue 14): a log of 300 requests from three tenants over several hours,
folded live by the fold worker in small, uneven passes with two restarts (each redelivering
what its checkpoint had not covered), then every projection dropped and rebuilt from the store:
each read model's digest, and the digest of the bills themselves, identical — on SQLite and
PostgreSQL. Safeguard off: the additive `usage_hourly` fold handed the same records twice without
its checkpoint must reach a different digest.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from datetime import UTC, datetime, timedelta

import orjson
import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.projections import USAGE_HOURLY
from tollgate_llm.domain.registry import to_payload
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    CancelRequest,
    Command,
    CompleteRequest,
    FailRequest,
    RouteRequest,
)
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.worker import FoldWorker

MODEL = "llama-3.1-8b-2026-05"
TENANTS = ("acme", "globex", "initech")
T0 = datetime.now(UTC) - timedelta(hours=6)


def _history(store: SqlEventStore, rng: random.Random) -> None:
    at = T0 - timedelta(days=1)
    price = NewEvent(
        str(uuid.uuid4()), f"prices-{MODEL}", "", at, PriceSet(MODEL, 150_000, 600_000, 75_000, at)
    )
    store.append(price.stream_id, 0, [price])
    for i in range(300):
        tenant = TENANTS[i % 3]
        rid = f"req_{uuid.uuid4().hex}"
        when = T0 + timedelta(seconds=70 * i)
        prompt, out = rng.randint(1, 900), rng.randint(0, 700)
        cached = rng.randint(0, prompt)
        end: Command = rng.choice(
            [
                CompleteRequest(prompt, out, cached, "stop", 30, 20_000, request_id=rid),
                CancelRequest(prompt, out // 2, cached, request_id=rid),
                FailRequest(prompt, out // 3, cached, "replica died", request_id=rid),
            ]
        )
        events = b.decided(
            AdmitRequest(
                rid,
                tenant,
                f"key-{tenant}",
                MODEL,
                "standard",
                "edge-1",
                Estimate(prompt, 1_000, 1_000, 40_000),
            ),
            RouteRequest("replica-1", 0, request_id=rid),
            end,
            at=when,
        )
        store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, tenant, when, e) for e in events])


def _bills_digest(store: SqlEventStore) -> str:
    digest = hashlib.sha256()
    bills = sorted(
        (r.stream_id, orjson.dumps(to_payload(r.event), option=orjson.OPT_SORT_KEYS))
        for r in store.read_all(0, 100_000)
        if r.type == "UsageBilled"
    )
    for stream_id, payload in bills:
        digest.update(stream_id.encode() + payload + b"\n")
    return digest.hexdigest()


def _fold_live(engine: sa.Engine, rng: random.Random) -> FoldWorker:
    worker = FoldWorker(engine)
    worker.catch_up()
    for restart in range(3):
        for _ in range(rng.randint(3, 8)):
            worker.run_pass(batch=rng.randint(5, 60))
        if restart < 2:  # a crash: the next worker starts from the saved checkpoints
            worker = FoldWorker(engine)
            worker.catch_up()
    while worker.run_pass(batch=500):
        pass
    worker.run_pass()
    return worker


def test_every_projection_rebuilt_from_the_store_is_identical(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    rng = random.Random(14)
    _history(store, rng)
    worker = _fold_live(engine, rng)
    live = {runner.name: runner.table_digest() for runner in worker.runners}
    bills = _bills_digest(store)
    for runner in worker.runners:
        runner.rebuild(batch=rng.randint(50, 400))
    rebuilt = {runner.name: runner.table_digest() for runner in worker.runners}
    # Billing again from position 0 (a lost billing checkpoint): the same bills, none added.
    again = FoldWorker(engine)
    again.billing.position = 0
    again.billing.run_to_end()
    records = store.read_all(0, 100_000)
    billed = sum(1 for r in records if r.type == "UsageBilled")
    differ = [name for name in live if live[name] != rebuilt[name]]
    print(
        f"replay determinism ({engine.dialect.name}): operations {len(records)} events, 3 "
        f"projections rebuilt / faults injected 2 restarts, uneven batches, billing from 0 / "
        f"lost {300 - billed} / duplicated {max(0, billed - 300)} / invariant violations "
        f"{len(differ) + (bills != _bills_digest(store))}; digests "
        + ", ".join(f"{n} {d[:12]}" for n, d in live.items())
    )
    assert differ == [] and billed == 300
    assert _bills_digest(store) == bills


def test_without_its_checkpoint_a_redelivery_changes_the_digest(sqlite_url: str) -> None:
    """The safeguard off: usage_hourly folded from records handed in twice, no checkpoint."""
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    try:
        store = SqlEventStore(engine)
        _history(store, random.Random(14))
        worker = _fold_live(engine, random.Random(14))
        records = store.read_all(0, 100_000)
    finally:
        engine.dispose()

    def fold(handed: list[Recorded]) -> dict[object, object]:
        rows: dict[object, object] = {}
        for record in handed:
            key = USAGE_HOURLY.key(record)
            if key is not None:
                rows[key] = USAGE_HOURLY.project(rows.get(key), record)  # type: ignore[arg-type]
        return rows

    once, twice = fold(records), fold(records + records[len(records) // 2 :])
    print(
        f"replay determinism (safeguard off): {sum(once[k] != twice[k] for k in once)} of "
        f"{len(once)} usage_hourly rows differ after a redelivery without the checkpoint"
    )
    assert once != twice
    assert worker.runners  # the live fold ran on the same history
