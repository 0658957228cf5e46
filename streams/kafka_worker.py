"""The Kafka fold worker (distributed mode): billing and the read models over the event topic,
the lease sweeper over the store. `tollgate worker` runs it when TOLLGATE_KAFKA_BOOTSTRAP is set.

Several workers form one consumer group and split the topic's partitions (a tenant's events are
in one partition, so every ledger row, request-log row and hourly-usage row is written by the
worker that holds that tenant). Each batch:

1. polls records through the consumer port (`KafkaEventConsumer`);
2. bills the requests they end (`BillingFold.bill`: deterministic bill ids and the request
   stream's expected version make a repeated bill a no-op in the store);
3. in one PostgreSQL transaction: claims the batch (locks this group's offsets of its partitions
   and drops records already applied), writes the read models' rows for what is left, posts
   the bills of the requests it ends (their ledger rows and usage_hourly shares, from the bills
   as stored), and saves the offsets — rows and offsets commit together, so no redelivery
   applies a row twice.

The bills a batch appends also come back through the relay; the worker holding their tenant
posts one only if its ledger row does not exist yet (a row exists only once its bill is posted).
A worker killed at any point repeats at most its batch: bills already in the store are answered
as already there, rows not committed are written once.

The sweeper needs every edge's renewals, which are one stream per edge, not per tenant, so it
cannot be split by tenant partition: it follows the store through `SqlTail`, in one worker of
the group at a time, which hands over to another when it dies (`streams.sweeper.GroupSweeper`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.leases import LEASE_TTL_S
from tollgate_llm.domain.projections import LEDGER_ENTRIES, PROJECTIONS, REQUEST_LOG, USAGE_HOURLY
from tollgate_llm.domain.requests.events import TERMINAL_TYPES, UsageBilled
from tollgate_llm.ledger import dead_letters, faults
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.dead_letters import is_transient
from tollgate_llm.ledger.engine import WRITE, create_engine_from_url
from tollgate_llm.ledger.finance import posted
from tollgate_llm.ledger.idempotency import IdempotencyStore
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.billing import BillingFold
from tollgate_llm.streams.consumer import Batch, Delivery, EventConsumer
from tollgate_llm.streams.gc_settings import settle_for_batches
from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer
from tollgate_llm.streams.metrics import ConsumerLagCollector, PipelineMetrics, serve_metrics
from tollgate_llm.streams.reconciler import start_reconciler
from tollgate_llm.streams.status import BrokerWatermarks
from tollgate_llm.streams.sweeper import GroupSweeper
from tollgate_llm.streams.topics import DEFAULT_TOPIC, group_for
from tollgate_llm.streams.worker import DEAD_LETTERS_IN_A_ROW, FoldBroken
from tollgate_llm.streams.worker_rows import (
    WORKER_NAME,
    delete_status_row,
    process_row,
    write_status_row,
)

if TYPE_CHECKING:
    from tollgate_llm.streams.faust_worker import FaustEventConsumer

log = logging.getLogger("tollgate.kafka_worker")


class KafkaFoldWorker:
    def __init__(
        self,
        engine: sa.Engine,
        consumer: EventConsumer,
        *,
        lease_ttl_s: float = LEASE_TTL_S,
        name: str = WORKER_NAME,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or PipelineMetrics()
        self.consumer = consumer
        self.name = name
        self.store = SqlEventStore(engine)
        self.control = ControlView()
        self.control_log = ControlLog(self.store, self.control)
        self.billing = BillingFold(self.store, Checkpoints(engine), self.control, engine=engine)
        # One runner per read model of domain's list, each fed by what it follows: request_log
        # every record, usage_hourly and ledger_entries each posted bill (written together). A
        # view added to the list and not fed here stops the worker at start, not silently.
        runners = {spec.name: ProjectionRunner(engine, self.store, spec) for spec in PROJECTIONS}
        self.request_log = runners.pop(REQUEST_LOG.name)
        self.usage_hourly = runners.pop(USAGE_HOURLY.name)
        self.ledger = runners.pop(LEDGER_ENTRIES.name)
        if runners:
            raise RuntimeError(f"read models this worker does not feed: {sorted(runners)}")
        self.sweeper = GroupSweeper(
            engine, self.store, name=name, ttl_s=lease_ttl_s,
            on_expired=IdempotencyStore(engine).release_request,
        )  # fmt: skip
        self.folded = 0  # records applied by this process
        self.bills = 0
        self.errors: dict[str, str] = {}
        # Poison isolation (DESIGN.md invariant 12): a record a fold cannot apply alone goes to
        # the dead-letter table and the batch commits without it; off only in the tests' twin.
        self.isolate_poison = True
        self.dead_lettered = 0  # records this process dead-lettered
        # The newest terminal instant this worker billed, for the billing lag.
        self.last_billed_at: datetime | None = None
        # A failed batch's rewind not done yet (run_batch). Only a safeguard-off test clears
        # rewinds_owed_first, to show what skipping a failed rewind loses.
        self._rewind_owed = False
        self.rewinds_owed_first = True
        self.last_batch_at: datetime | None = None  # the last poll that brought records

    def start(self) -> None:
        """Take the sweeper's lead if it is free (a standby tries again at every sweep)."""
        self.sweeper.lead()

    def run_batch(self, max_records: int = 5000, timeout_s: float = 0.2) -> int:
        """One batch from the topic; returns how many records it applied.

        After a failed batch the consumer must go back to its checkpoint before anything else
        is applied (DESIGN.md invariant 11). That rewind can fail too — on confluent it reads
        the saved offsets from PostgreSQL, which is what just failed — and a consumer that
        carried on from where it was would commit the next batch's offsets past the failed
        records: their requests would never be billed. So the rewind is owed from before it
        is tried until it succeeds, and an owed rewind is retried first: while it fails, this
        raises and nothing is polled or applied. A poll that fails is owed a rewind too: it
        may have taken records from the broker (the consumer's position moved past them)
        without handing them over, and the next poll would start after them."""
        if self._rewind_owed:
            self._rewind()
        try:
            batch = self.consumer.poll(max_records, timeout_s)
        except Exception:
            self._rewind_owed = self.rewinds_owed_first
            raise
        if not batch.next_offsets:
            return 0
        self.last_batch_at = datetime.now(UTC)
        try:
            applied = self._apply(batch)
        except Exception:
            # Nothing of the batch's rows or offsets committed: read it again.
            self._rewind_owed = self.rewinds_owed_first
            self._rewind()
            raise
        self.folded += applied
        return applied

    def _rewind(self) -> None:
        self.consumer.rewind()
        self._rewind_owed = False

    def _apply(self, batch: Batch) -> int:
        self.control_log.follow()  # prices in force at admission, before billing with them
        records = [d.record for d in batch.deliveries]
        billed, bills = self._bill(batch)
        self.bills += billed
        if records:
            faults.point("kafka.after_bills", records=len(records))
        try:
            posted, fresh = self._commit(batch, bills, isolate=False)
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise  # rewound and read again: the database's failure, not a record's
            # One record a fold cannot apply must not hold back the partition (and with it
            # every tenant on it): the batch again, each fold apart, each record apart where
            # its fold fails, in the same transaction as the offsets.
            log.warning("a batch failed (%s); applying it fold by fold", exc)
            posted, fresh = self._commit(batch, bills, isolate=True)
        self.metrics.observe_ledger_rows(posted, datetime.now(UTC))
        return len(fresh)

    def _bill(self, batch: Batch) -> tuple[int, list[Recorded]]:
        """`BillingFold.bill_recorded` over the batch; when it fails for a reason that is not
        the database's, record by record, and the record that fails alone twice is
        dead-lettered (the bills are in the store before the offsets move, so a record billed
        here and then rewound is answered as already billed)."""
        records = [d.record for d in batch.deliveries]
        try:
            return self.billing.bill_recorded(records)
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise
            log.warning("billing failed on a batch (%s); billing it record by record", exc)
        billed, bills = 0, []
        for delivery in batch.deliveries:
            failure: Exception | None = None
            for _ in range(2):
                try:
                    n, stored = self.billing.bill_recorded([delivery.record])
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    failure = exc
                else:
                    billed, failure = billed + n, None
                    bills += stored
                    break
            if failure is not None:
                if not dead_letters.database_answers(self.engine):
                    raise failure
                with self.engine.connect() as conn:
                    conn.execution_options(**{WRITE: True})
                    with conn.begin():
                        self._dead_letter(conn, BillingFold.name, delivery, failure)
        return billed, bills

    def _commit(
        self, batch: Batch, bills: list[Recorded], *, isolate: bool
    ) -> tuple[list[Recorded], list[Recorded]]:
        """Claim the batch, write the read models' rows, save the offsets: one transaction.
        `isolate`: each fold in a savepoint of its own, and where a fold fails, each record
        (a request's log row; a bill's ledger row with its usage_hourly share, which are
        posted together) in one; a record that fails twice is dead-lettered in this same
        transaction and the rest commits with the offsets."""
        where = {d.record.event_id: d for d in batch.deliveries}
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                fresh = [d.record for d in self.consumer.claim(conn, batch)]
                ended = {r.stream_id for r in fresh if r.type in TERMINAL_TYPES}
                # The bills of the requests this transaction ends, and the bills the topic
                # brings back, posted once each: a ledger row is written in the transaction
                # that adds its bill to usage_hourly, so "the row exists" is "it was posted".
                posted = self._unposted(
                    conn,
                    [bill for bill in bills if bill.stream_id in ended]
                    + [r for r in fresh if type(r.event) is UsageBilled],
                )
                if not isolate:
                    self.request_log.apply_claimed(conn, fresh)
                    self._post(conn, posted)
                else:
                    self._isolated(
                        conn, (self.request_log.name,), self.request_log.apply_claimed, fresh,
                        where,
                    )  # fmt: skip
                    applied = self._isolated(
                        conn, (self.usage_hourly.name, self.ledger.name), self._post, posted,
                        where,
                    )  # fmt: skip
                    posted = [r for r in posted if r.event_id in applied]
                self.consumer.commit(conn, batch)
                faults.point("kafka.before_commit", records=len(fresh))
        return posted, fresh

    def _post(self, conn: sa.Connection, bills: list[Recorded]) -> None:
        self.usage_hourly.apply_claimed(conn, bills)
        self.ledger.insert_claimed(conn, bills)

    def _isolated(
        self, conn: sa.Connection, folds: tuple[str, ...],
        apply: Callable[[sa.Connection, list[Recorded]], None], records: list[Recorded],
        where: dict[str, Delivery],
    ) -> set[str]:  # fmt: skip
        """`apply(conn, records)` in a savepoint; if that fails for a reason that is not the
        database's, each record in one of its own (twice), dead-lettering under `folds` the
        one that still fails. Returns the event ids applied."""
        if not records:
            return set()
        try:
            with conn.begin_nested():
                apply(conn, records)
            return {r.event_id for r in records}
        except Exception as exc:
            if is_transient(exc):
                raise
        applied: set[str] = set()
        failed: list[tuple[Recorded, Exception]] = []
        for record in records:
            failure: Exception | None = None
            for _ in range(2):
                try:
                    with conn.begin_nested():
                        apply(conn, [record])
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    failure = exc
                else:
                    failure = None
                    applied.add(record.event_id)
                    break
            if failure is not None:
                failed.append((record, failure))
        if len(failed) > DEAD_LETTERS_IN_A_ROW and not applied:
            # The fold fails on everything: it, not its records, is broken. The batch is
            # rewound and retried, as a database failure is.
            raise FoldBroken(
                f"{'/'.join(folds)} failed on all {len(failed)} records of a batch; not "
                f"dead-lettering them (the fold looks broken): {failed[0][1]}"
            ) from failed[0][1]
        for record, failure in failed:
            for fold in folds:
                self._dead_letter(conn, fold, where.get(record.event_id), failure, record)
        return applied

    def _dead_letter(
        self, conn: sa.Connection, fold: str, delivery: Delivery | None, failure: Exception,
        record: Recorded | None = None,
    ) -> None:  # fmt: skip
        """Record one dead letter inside `conn`'s transaction, with its place on the topic
        when it came from there (a bill this batch appended did not)."""
        record = record or (delivery.record if delivery is not None else None)
        assert record is not None
        letter = dead_letters.DeadLetter.of(
            fold, record, failure, topic=getattr(self.consumer, "topic", None),
            partition=delivery.partition if delivery else None,
            offset=delivery.offset if delivery else None,
        )  # fmt: skip
        dead_letters.record(conn, [letter], datetime.now(UTC))
        self.dead_lettered += 1
        log.error(
            "%s: dead-lettered event %s (partition %s, offset %s): %s",
            fold, letter.event_id, letter.partition, letter.offset, letter.reason,
        )  # fmt: skip

    @staticmethod
    def _unposted(conn: sa.Connection, bills: list[Recorded]) -> list[Recorded]:
        """`bills` (one per request) whose ledger row does not exist yet. Inside the claim's
        transaction: a bill and its terminal event share a partition, whose offsets row the
        claim locked, so no other worker posts one of these meanwhile."""
        first = {bill.stream_id: bill for bill in reversed(bills)}
        if not first:
            return []
        done = posted(conn, list(first))
        return [bill for rid, bill in first.items() if rid not in done]

    def sweep(self) -> None:
        """As the sweeper's leader: follow the store into the lease book and expire the silent
        leases (a standby only checks whether the lead is free)."""
        self.sweeper.step(datetime.now(UTC))

    def status(self) -> dict[str, Any]:
        """This member's own `worker_status` row: its partitions, its last batch and, where its
        consumer knows it, its lag. Its `position` is the sweeper's, so only the sweeper's leader
        reports one: a standby's (it follows nothing) would read as a stalled worker."""
        # A consumer without partitions (the SQL tail of the tests) reports none.
        assigned = getattr(self.consumer, "assigned", None)
        lag = getattr(self.consumer, "lag", None)
        return {
            **process_row(self.name),
            "position": self.sweeper.position if self.sweeper.leading else None,
            "billing_lag": 0,
            "error": "; ".join(f"{k}: {v}" for k, v in self.errors.items()) or None,
            "dead_letters": self.consumer.dead_letters + len(self.billing.dead_letters),
            "dead_letter_sample": None,
            "partitions": ",".join(map(str, sorted(assigned))) if assigned is not None else None,
            "last_batch_at": self.last_batch_at,
            "lag": lag() if lag is not None else None,
        }

    def run(self, stop: threading.Event, *, sweep_every_s: float = 0.5) -> None:
        """Batch after batch until `stop`; the sweeper and the status row on their own beat."""
        next_sweep = next_status = 0.0
        while not stop.is_set():
            self._step("folds", self.run_batch)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + sweep_every_s
                self._step("sweeper", self.sweep)
            if now >= next_status:
                next_status = now + 1.0
                try:
                    write_status_row(self.engine, self.status())
                except Exception:
                    log.exception("could not write the worker status")
            if self.errors:
                stop.wait(1.0)  # a failing step is retried, not spun on

    def _step(self, name: str, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as exc:
            log.exception("%s failed", name)
            self.errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            self.errors.pop(name, None)


def run_kafka_worker(
    database_url: str,
    bootstrap: str,
    topic: str = DEFAULT_TOPIC,
    *,
    group: str | None = None,
    lease_ttl_s: float = LEASE_TTL_S,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    client: str = "confluent",
    kafka_settings: Mapping[str, str] | None = None,
) -> None:
    """`tollgate worker` with a Kafka cluster: fold until SIGTERM/SIGINT (its /metrics on
    `metrics_port`, 0: off), reading the topic through `client`: confluent-kafka, or
    faust-streaming (`streams/faust_worker.py`), the same batches either way."""
    engine = create_engine_from_url(database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    group = group or group_for(topic)
    consumer: KafkaEventConsumer | FaustEventConsumer
    if client == "faust":
        from tollgate_llm.streams.faust_worker import FaustEventConsumer

        consumer = FaustEventConsumer(engine, bootstrap, topic, group,
                                      kafka_settings=kafka_settings)  # fmt: skip
    else:
        consumer = KafkaEventConsumer(engine, bootstrap, topic, group,
                                      kafka_settings=kafka_settings)  # fmt: skip
    worker = KafkaFoldWorker(engine, consumer, lease_ttl_s=lease_ttl_s)
    # Watermarks through a client of their own: the scrape runs on another thread than the
    # consumer's loop.
    probe = BrokerWatermarks(bootstrap, kafka_settings=kafka_settings) if metrics_port else None
    if probe is not None:
        worker.metrics.registry.register(
            ConsumerLagCollector(engine, group, topic, lambda: set(consumer.assigned), probe)
        )
    serve_metrics(metrics_port, worker.metrics.registry, metrics_host)
    start_reconciler(engine, worker.store, stop, ttl_s=lease_ttl_s, metrics=worker.metrics)
    try:
        worker.start()
        settle_for_batches()
        log.info("kafka fold worker %d reading %s as %s (%s)", os.getpid(), topic, group, client)
        worker.run(stop)
    finally:
        worker.sweeper.release()
        delete_status_row(engine, worker.name)
        consumer.close()
        if probe is not None:
            probe.close()
        engine.dispose()
