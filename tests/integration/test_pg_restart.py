"""A real PostgreSQL restart under a folding Kafka worker (issue 26, item 1; DESIGN.md invariant
11): a private cluster the test starts on its own port, requests appended without pause, the
relay publishing them and a Kafka worker billing them, while the cluster is stopped `-m fast`
and `-m immediate` and started again. Afterwards every terminal event in the store has exactly
one bill and one ledger row. With the worker's owed rewind switched off (the safeguard-off
twin), a batch that failed with the database is skipped for good: bills are lost."""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests import builders as b
from tests.pg_cluster import private_cluster
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    CancelRequest,
    Command,
    CompleteRequest,
    RouteRequest,
)
from tollgate_llm.domain.requests.events import TERMINAL_TYPES
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.schema import events, ledger_entries, upgrade
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.streams.consumer import Batch
from tollgate_llm.streams.relay import OutboxRelay

pytestmark = [pytest.mark.kafka]
MODEL = "llama-3.1-8b-2026-05"
# Each kind of stop twice, each while the worker holds a batch it has not applied.
STOPS = ["fast", "immediate", "fast", "immediate"]


class Appender:
    """Requests of six tenants, a few every 20 ms, each admitted, routed and ended in one
    append, until `stop`; an append refused by a database that is down is tried again later."""

    def __init__(self, store: SqlEventStore) -> None:
        self.store = store
        self.rng = random.Random(261)
        self.stopping = threading.Event()
        self.refused = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.02):
            try:
                for result in self.store.append_many([self._request() for _ in range(4)]):
                    result.unwrap()
            except (StoreUnavailable, sa.exc.DBAPIError):
                self.refused += 1
                self.stopping.wait(0.1)

    def _request(self) -> AppendBatch:
        rng = self.rng
        rid, tenant = "req_" + uuid.uuid4().hex, f"tenant-{rng.randrange(6)}"
        prompt, completion = rng.randrange(10, 2000), rng.randrange(1, 500)
        end: Command = rng.choice(
            [
                CompleteRequest(prompt, completion, 0, "stop", 30, 20_000, request_id=rid),
                CancelRequest(prompt, completion, 0, request_id=rid),
            ]
        )
        now = datetime.now(UTC)
        decided = b.decided(
            AdmitRequest(
                rid, tenant, "key-1", MODEL, "standard", "edge-1",
                Estimate(prompt, 500, 1_000, 40_000),
            ),
            RouteRequest("replica-1", 0, request_id=rid),
            end,
            at=now,
        )  # fmt: skip
        return AppendBatch(
            rid, 0, [NewEvent(str(uuid.uuid4()), rid, tenant, now, e) for e in decided]
        )

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)


def _figures(engine: sa.Engine) -> tuple[set[str], dict[str, int], dict[str, int]]:
    """The requests with a terminal event, bills per request, ledger rows per request."""
    with engine.connect() as conn:
        ended = set(
            conn.execute(
                sa.select(events.c.stream_id).where(events.c.type.in_(sorted(TERMINAL_TYPES)))
            ).scalars()
        )
        bills = dict(
            conn.execute(
                sa.select(events.c.stream_id, sa.func.count())
                .where(events.c.type == "UsageBilled")
                .group_by(events.c.stream_id)
            ).all()
        )
        rows = dict(
            conn.execute(
                sa.select(ledger_entries.c.request_id, sa.func.count()).group_by(
                    ledger_entries.c.request_id
                )
            ).all()
        )
    return ended, bills, rows


@pytest.mark.parametrize("safeguard", ["on", "off"])
def test_a_postgres_restart_under_a_kafka_worker_loses_no_bill(
    kafka_broker: Any, kafka_topic: str, tmp_path: Path, safeguard: str
) -> None:
    from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker
    from tollgate_llm.streams.topics import group_for

    class Worker(KafkaFoldWorker):
        """Stops the cluster when armed, once it holds a batch: the batch fails, then its
        rewind's read of the saved offsets."""

        halt: str = ""
        halted = threading.Event()
        failed_batches = 0

        def _apply(self, batch: Batch) -> int:
            if self.halt and batch.deliveries:
                cluster.halt(self.halt)
                self.halt = ""
                self.halted.set()
            try:
                return super()._apply(batch)
            except Exception:
                self.failed_batches += 1
                raise

    with private_cluster(tmp_path) as cluster:
        upgrade(cluster.url)
        engine = create_engine_from_url(cluster.url)
        store = SqlEventStore(engine)
        at = datetime.now(UTC) - timedelta(days=1)
        price = PriceSet(MODEL, 150_000, 600_000, 75_000, at)
        store.append(
            f"prices-{MODEL}", 0, [NewEvent(str(uuid.uuid4()), f"prices-{MODEL}", "", at, price)]
        )
        relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=4)
        relay.check_topic()
        consumer = KafkaEventConsumer(
            engine, kafka_broker.bootstrap, kafka_topic, group_for(kafka_topic)
        )
        worker = Worker(engine, consumer)
        worker.rewinds_owed_first = safeguard == "on"
        stopping = threading.Event()
        threads = [
            threading.Thread(target=relay.run, args=(stopping,), daemon=True),
            threading.Thread(target=worker.run, args=(stopping,), daemon=True),
        ]
        for thread in threads:
            thread.start()
        appender = Appender(store)
        rng = random.Random(26)
        failing_stops: dict[str, int] = {"fast": 0, "immediate": 0}
        try:
            deadline = time.monotonic() + 60
            while worker.bills == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert worker.bills, "the worker billed nothing before the first stop"
            for mode in STOPS:
                time.sleep(rng.uniform(0.5, 1.0))  # folding under load
                failed = worker.failed_batches
                worker.halted.clear()
                worker.halt = mode
                assert worker.halted.wait(30), "the worker took no batch for 30 s"
                time.sleep(rng.uniform(1.0, 2.0))  # its rewind fails meanwhile
                failing_stops[mode] += worker.failed_batches > failed
                cluster.start()
            time.sleep(1.0)
            appender.stop()
            # Settled: every terminal billed, or nothing billed any more for 8 s.
            deadline = time.monotonic() + 60
            last, since = -1, time.monotonic()
            while time.monotonic() < deadline:
                ended, bills, rows = _figures(engine)
                if ended and ended <= set(rows):
                    break
                if len(rows) != last:
                    last, since = len(rows), time.monotonic()
                elif time.monotonic() - since > 8:
                    break
                time.sleep(0.5)
            time.sleep(1.0)  # late redeliveries must change nothing
            ended, bills, rows = _figures(engine)
        finally:
            appender.stop()
            stopping.set()
            for thread in threads:
                thread.join(30)
            consumer.close()
            relay.close()
            engine.dispose()
    unbilled = ended - set(bills)
    unposted = ended - set(rows)
    doubled = [r for r, n in {**bills, **rows}.items() if n > 1]
    print(
        f"postgres restart (safeguard {safeguard}): {len(STOPS)} stops "
        f"({sum(failing_stops.values())} with a failed batch: {failing_stops}), "
        f"{len(ended)} terminal events, {appender.refused} appends refused / "
        f"{len(unbilled)} without a bill, {len(unposted)} without a ledger row, "
        f"{len(doubled)} doubled"
    )
    # Each stop failed a batch in flight: otherwise the test proved nothing.
    assert failing_stops == {"fast": 2, "immediate": 2}, failing_stops
    if safeguard == "off":
        assert unposted, "with the owed rewind off, a failed batch should be skipped for good"
        return
    assert len(ended) > 100
    assert unbilled == set() and unposted == set() and doubled == []
    assert set(bills) == ended and set(rows) == ended
