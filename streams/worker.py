"""The fold worker: billing, the read models and the lease sweeper, in a process of their own.

`tollgate worker` runs it; `tollgate serve` starts one as a child process (and restarts it if it
dies). Keeping the folds out of the edge's process keeps their CPU off the request path: an edge
thread folding a batch held the GIL for milliseconds at a time, which the event loop paid for in
latency. Everything here reads the event log and writes through the store, so a worker can run on
any machine that reaches the database, and a second one is harmless (checkpoint locks,
deterministic bill ids and expected versions keep every effect exactly-once).

Each pass reads the new events once and hands them to every fold; each fold fails, reports and
retries on its own. After every pass the worker writes its heartbeat, positions and problems to
`worker_status`, which the edges show on /readyz and /metrics.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa

from domain.control import ControlView
from domain.events import BatchCreated, Recorded
from domain.leases import LEASE_TTL_S
from domain.projections import LEDGER_ENTRIES, REQUEST_LOG, USAGE_HOURLY
from ledger import faults
from ledger.checkpoints import Checkpoints
from ledger.control import ControlLog
from ledger.engine import WRITE, create_engine_from_url
from ledger.idempotency import IdempotencyStore
from ledger.projections import ProjectionRunner
from ledger.schema import worker_status
from ledger.store import SqlEventStore
from streams.billing import BillingFold
from streams.gc_settings import settle_for_batches
from streams.metrics import PipelineMetrics, serve_metrics
from streams.sql_tail import SqlTail
from streams.status import DEFAULT_STALE_S
from streams.sweeper import LeaseSweeper, resume_sweeper

log = logging.getLogger("tollgate.worker")

WORKER_NAME = "folds"
# An edge calls the folds dead when the heartbeat is older than this (by default: the edge's
# TOLLGATE_PIPELINE_STALE_S sets it).
HEARTBEAT_STALE_S = DEFAULT_STALE_S
# Between two steps of a pass that is behind: time for an edge's append to take the write lock.
CATCH_UP_PAUSE_S = 0.002
BATCH_CREATED = BatchCreated.EVENT_TYPE


class FoldWorker:
    """The folds over one event store. `run_pass` is one step; `run` loops until stopped."""

    def __init__(
        self, engine: sa.Engine, *, lease_ttl_s: float = LEASE_TTL_S, name: str = WORKER_NAME,
        metrics: PipelineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or PipelineMetrics()
        self.name = name
        self.store = SqlEventStore(engine)
        # The log through the consumer port; the folds keep their own positions (each moves
        # with its effect), so the tail is sought to the lowest before every read.
        self.tail = SqlTail(self.store, engine, f"{name}-tail")
        # Billing prices each request with the price in force at its admission: the control
        # plane's history is folded here too (from the same records).
        self.control = ControlView()
        self.control_position = 0
        self.checkpoints = Checkpoints(engine)
        self.runners = [
            ProjectionRunner(engine, self.store, spec)
            for spec in (REQUEST_LOG, USAGE_HOURLY, LEDGER_ENTRIES)
        ]
        self.projection_position = 0
        self.billing = BillingFold(self.store, self.checkpoints, self.control)
        self._billing_saved = self.billing.position
        self.sweeper = LeaseSweeper(
            self.store, ttl_s=lease_ttl_s, on_expired=IdempotencyStore(engine).release_request
        )
        self.errors: dict[str, str] = {}
        self.read_position = 0  # the last position a pass read
        self._reported: tuple[Any, ...] | None = None  # the problems last written
        self._reported_at = 0.0
        # Told when a pass reads a BatchCreated (the batch runner beside the folds, if any).
        self.on_batch_created: Callable[[], None] | None = None

    # --- start-up ------------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Fold the control plane, bring every fold up to the end of the log, and resume the
        sweeper from the requests that have not ended (an edge may have died with requests in
        flight)."""
        self.control_position = ControlLog(self.store, self.control).position
        for runner in self.runners:
            runner.run_to_end()
        self.projection_position = min(runner.checkpoint() for runner in self.runners)
        self.billing.run_to_end()
        resume_sweeper(self.engine, self.store, self.sweeper)

    # --- one pass ------------------------------------------------------------------------------

    def run_pass(self, batch: int = 500) -> int:
        """Read the new events once, hand them to every fold, then sweep expired leases.
        Returns how many events were read. (The bills a pass appends are projected by the next
        pass: a pass reads the log once, before billing.)

        Behind (after a burst, or at start-up), it folds `batch` events at a time with a short
        pause in between: on SQLite each step's write transactions hold the database's only
        write lock, which the edges' admissions wait for; 5,000 events at once held it for tens
        of milliseconds."""
        errors: dict[str, str] = {}
        read = 0
        while True:
            start = min(
                self.control_position, self.sweeper.position, self.billing.position,
                self.projection_position,
            )
            try:
                self.tail.seek(start)
                records = self.tail.read(batch, 0)
            except Exception as exc:  # the database went away: report, and read again later
                log.exception("reading the log failed")
                errors["read"] = f"{type(exc).__name__}: {exc}"
                break
            read += len(records)
            if records:
                self.read_position = max(self.read_position, records[-1].position)
                faults.point("fold.after_read", position=self.read_position)
                if self.on_batch_created is not None and any(
                    r.event.EVENT_TYPE == BATCH_CREATED for r in records
                ):
                    self.on_batch_created()
            for name, step in (
                ("control", self._follow_control),
                ("billing", self._bill),
                ("projections", self._project),
                ("sweeper", self._follow_leases),
            ):
                try:
                    step(records)
                except Exception as exc:
                    log.exception("fold %s failed", name)
                    errors[name] = f"{type(exc).__name__}: {exc}"
            if "projections" in errors and "billing" not in errors:
                try:
                    self._save_billing_checkpoint()
                except Exception as exc:
                    log.exception("could not save the billing checkpoint")
                    errors["billing"] = f"{type(exc).__name__}: {exc}"
            if len(records) < batch or errors:
                break
            time.sleep(CATCH_UP_PAUSE_S)
        try:
            self.sweeper.sweep(datetime.now(UTC))
        except Exception as exc:
            log.exception("lease sweep failed")
            errors["sweeper"] = f"{type(exc).__name__}: {exc}"
        self.errors = errors
        return read

    def _follow_control(self, records: list[Recorded]) -> None:
        for record in records:
            if record.position > self.control_position:
                self.control.apply(record)
                self.control_position = record.position

    def _bill(self, records: list[Recorded]) -> None:
        # Its checkpoint is saved by _project, in the read models' transaction.
        self.billing.process(records, save_checkpoint=False)

    def _project(self, records: list[Recorded]) -> None:
        """All read models in one transaction: rows and checkpoints commit together, and the
        billing checkpoint with them.

        The new rows are computed first, outside the write transaction: on SQLite that
        transaction holds the database's only write lock, which the edges' admissions wait for
        (computing inside it held the lock for 4-9 ms per pass at 200 req/s, measured). If
        another runner moved a checkpoint meanwhile, that projection is computed again under
        the lock."""
        if not records:
            return
        # One read transaction: the runners read their checkpoints and rows in one snapshot
        # (and, on SQLite, through the driver).
        with self.engine.connect() as conn, conn.begin():
            prepared = [runner.prepare(conn, records) for runner in self.runners]
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                for runner, ready in zip(self.runners, prepared, strict=True):
                    if ready is not None and not runner.write(conn, ready):
                        runner.apply_recorded(conn, records)
                billed = self.billing.position
                self.checkpoints.set(self.billing.name, billed, conn)
                faults.point("projections.before_commit", position=records[-1].position)
        faults.point("projections.after_commit", position=records[-1].position)
        self.metrics.observe_ledger_rows(
            (r for r in records if r.position > self.projection_position), datetime.now(UTC)
        )
        self._billing_saved = billed
        self.projection_position = records[-1].position

    def _save_billing_checkpoint(self) -> None:
        """On its own, when the read models' transaction that carries it did not commit."""
        if self.billing.position != self._billing_saved:
            billed = self.billing.position
            self.checkpoints.set(self.billing.name, billed)
            self._billing_saved = billed

    def _follow_leases(self, records: list[Recorded]) -> None:
        for record in records:
            if record.position > self.sweeper.position:
                self.sweeper.apply(record)
                self.sweeper.position = record.position

    # --- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        dead = self.billing.dead_letters
        return {
            "name": self.name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "heartbeat_at": datetime.now(UTC),
            "position": min(self.billing.position, self.projection_position),
            # What this pass read and billing has not applied: it grows while billing fails.
            "billing_lag": max(0, self.read_position - self.billing.position),
            "error": "; ".join(f"{k}: {v}" for k, v in self.errors.items()) or None,
            "dead_letters": len(dead),
            "dead_letter_sample": orjson.dumps(dict(list(dead.items())[:3])).decode()
            if dead
            else None,
        }

    def write_status(self, *, every_s: float = 1.0) -> None:
        """Upsert this worker's row: at once when its problems change, else (heartbeat,
        positions, lag) every `every_s`. Every pass would be ten write transactions a second
        competing with the edges' appends for SQLite's write lock."""
        row = self.status()
        problems = (row["error"], row["dead_letters"])
        now = time.monotonic()
        if problems == self._reported and now - self._reported_at < every_s:
            return
        self._reported, self._reported_at = problems, now
        write_status_row(self.engine, row)

    # --- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event, *, interval_s: float = 0.1, parent_pid: int = 0) -> None:
        """Pass after pass, at most every `interval_s` (the folds then work in batches: one
        read, one commit per pass). Stops on `stop`, or when `parent_pid` is given and that
        process is gone (an edge killed with -9 takes its worker with it); the last passes
        fold what was committed before the stop, and the bills they append."""
        while not stop.is_set():
            self._pass_and_report()
            if parent_pid and os.getppid() != parent_pid:
                log.warning("parent process %d is gone; stopping", parent_pid)
                break
            stop.wait(1.0 if self.errors else interval_s)
        for _ in range(10):
            if not self._pass_and_report() or self.errors:
                break

    def _pass_and_report(self) -> int:
        read = self.run_pass()
        try:
            self.write_status()
        except Exception:
            log.exception("could not write the worker status")
        return read


@faults.seam("db.status")
def write_status_row(engine: sa.Engine, row: dict[str, Any]) -> None:
    """Upsert one worker's `worker_status` row (keyed by `row["name"]`). A row without a
    `position` (a Kafka worker that does not lead the sweeper) only refreshes an existing row:
    the row is created by a worker that knows its position."""
    with engine.connect() as conn:
        conn.execution_options(**{WRITE: True})
        with conn.begin():
            updated = conn.execute(
                worker_status.update().where(worker_status.c.name == row["name"]).values(**row)
            ).rowcount
            if not updated and "position" in row:
                conn.execute(worker_status.insert().values(**row))


@dataclass(frozen=True, slots=True)
class FoldStatus:
    """What an edge knows of the folds, from `worker_status`."""

    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    billing_lag: int
    dead_letters: int


def read_fold_status(
    engine: sa.Engine, now: datetime, name: str = WORKER_NAME,
    stale_s: float = HEARTBEAT_STALE_S,
) -> FoldStatus:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(worker_status).where(worker_status.c.name == name)
        ).mappings().first()
    if row is None:
        return FoldStatus(("folds: no fold worker has reported yet",), (), 0, 0)
    problems: list[str] = []
    warnings: list[str] = []
    age = (now - row["heartbeat_at"]).total_seconds()
    if age > stale_s:
        problems.append(f"folds: the fold worker (pid {row['pid']}) last reported {age:.0f} s ago")
    if row["error"]:
        problems.append(f"folds: {row['error']}")
    if row["dead_letters"]:
        sample = orjson.loads(row["dead_letter_sample"] or "{}")
        warnings.append(
            f"billing: {row['dead_letters']} request(s) could not be billed, e.g. "
            + "; ".join(f"{k} ({v})" for k, v in sample.items())
        )
    return FoldStatus(tuple(problems), tuple(warnings), row["billing_lag"], row["dead_letters"])


def run_worker(
    database_url: str, *, lease_ttl_s: float = LEASE_TTL_S, parent_pid: int = 0,
    metrics_port: int = 0,
) -> None:
    """`tollgate worker`: catch up, then fold until SIGTERM/SIGINT (or the parent is gone); its
    /metrics on `metrics_port` (0: off)."""
    engine = create_engine_from_url(database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # The billing-lag histogram only where it is served: observing every bill costs the
    # embedded worker (`tollgate serve`'s child, no /metrics of its own) ~10 us per request.
    worker = FoldWorker(
        engine, lease_ttl_s=lease_ttl_s, metrics=PipelineMetrics(billing=bool(metrics_port))
    )
    serve_metrics(metrics_port, worker.metrics.registry)
    runner = _batch_runner(engine, worker, stop)
    try:
        while True:  # a database that is away at start (or drops us meanwhile) is waited for
            try:
                worker.catch_up()
                break
            except Exception:
                log.exception("catching up failed; trying again in 1 s")
                if stop.wait(1.0):
                    return
        log.info("fold worker %d caught up at position %d", os.getpid(), worker.billing.position)
        if runner is not None:
            runner.start()
        settle_for_batches()
        worker.run(stop, parent_pid=parent_pid)
    finally:
        stop.set()
        if runner is not None:
            runner.join(timeout=10)
        engine.dispose()


def _batch_runner(
    engine: sa.Engine, worker: FoldWorker, stop: threading.Event
) -> threading.Thread | None:
    """The batch runner beside the folds, when the edge told this worker where it is and how to
    prove itself (`tollgate serve` does, in the environment)."""
    from streams.batch_runner import BatchRunner

    edge_url = os.environ.get("TOLLGATE_EDGE_URL")
    token = os.environ.get("TOLLGATE_BATCH_TOKEN")
    if not edge_url or not token:
        log.info("no TOLLGATE_EDGE_URL/TOLLGATE_BATCH_TOKEN: batches are not run here")
        return None
    runner = BatchRunner(
        engine, worker.store, edge_url=edge_url, token=token,
        concurrency=int(os.environ.get("TOLLGATE_BATCH_CONCURRENCY", "8")),
    )
    worker.on_batch_created = runner.nudge  # idle, it polls once a second: start a new one now
    return threading.Thread(target=runner.run, args=(stop,), name="batch-runner", daemon=True)
