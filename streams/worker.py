"""The fold worker: billing, the read models and the lease sweeper, in a process of their own.

`tollgate worker` runs it; `tollgate serve` starts one as a child process (and restarts it if it
dies). Keeping the folds out of the edge's process keeps their CPU off the request path: an edge
thread folding a batch held the GIL for milliseconds at a time, which the event loop paid for in
latency. Everything here reads the event log and writes through the store, so a worker can run on
any machine that reaches the database, and a second one is harmless (checkpoint locks,
deterministic bill ids and expected versions keep every effect exactly-once).

Each pass reads the new events once and hands them to every fold; each fold fails, reports and
retries on its own, and none waits on another: billing (the money path) and each read model keep
their own positions, a read model that is behind reads on its own until it is back in step, and
an event that one fold cannot apply goes to the dead-letter table (ledger/dead_letters.py) so
that fold moves past it (DESIGN.md invariant 12). After every pass the worker writes its
heartbeat, positions and problems to `worker_status`, which the edges show on /readyz and
/metrics.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa

from tollgate_llm.domain.batches.events import BatchCreated
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.leases import LEASE_TTL_S
from tollgate_llm.domain.projections import LEDGER_ENTRIES, PROJECTIONS
from tollgate_llm.domain.requests.events import TERMINAL_TYPES
from tollgate_llm.ledger import dead_letters, faults
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.dead_letters import DeadLetter, is_transient
from tollgate_llm.ledger.engine import WRITE, create_engine_from_url
from tollgate_llm.ledger.idempotency import IdempotencyStore
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.batch_runner import BatchRunner
from tollgate_llm.streams.billing import BillingFold
from tollgate_llm.streams.gc_settings import settle_for_batches
from tollgate_llm.streams.metrics import DeadLettersCollector, PipelineMetrics, serve_metrics
from tollgate_llm.streams.reconciler import Handoff, start_reconciler
from tollgate_llm.streams.sql_tail import SqlTail
from tollgate_llm.streams.sweeper import LeaseSweeper, resume_sweeper
from tollgate_llm.streams.worker_rows import (
    WORKER_NAME,
    delete_status_row,
    process_row,
    write_status_row,
)

log = logging.getLogger("tollgate.worker")

# Between two steps of a pass that is behind: time for an edge's append to take the write lock.
CATCH_UP_PAUSE_S = 0.002
BATCH_CREATED = BatchCreated.EVENT_TYPE
# Events one fold dead-letters in a row, applying none in between, before it stops doing so and
# reports instead: the fold (a table dropped, a bug), not its events, is then what fails, and
# dead-lettering the whole log would only hide it (each stays replayable either way).
DEAD_LETTERS_IN_A_ROW = 20
# The most of its own bills the worker keeps for its next read (a read that stays behind them,
# while a fold fails, decodes them from the log instead).
OWN_BILLS_KEPT = 10_000


class FoldBroken(Exception):
    """A fold failed on too many events in a row to blame them: it retries, it does not
    dead-letter (DEAD_LETTERS_IN_A_ROW)."""


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
            for spec in PROJECTIONS
        ]
        # Each read model's position: they commit together while in step (one transaction a
        # pass), apart while one is behind or failing.
        self.positions = {runner.name: 0 for runner in self.runners}
        self.billing = BillingFold(self.store, self.checkpoints, self.control, engine=engine)
        # Poison isolation (DESIGN.md invariant 12); off only in the safeguard-off twin of the
        # tests, where one event a fold cannot apply stops the fold and, through the shared
        # read, billing.
        self.isolate_poison = True
        self._in_a_row: dict[str, int] = {}  # dead letters per fold since it last applied one
        self._window_start = 0  # where this step's common read started
        self._billing_saved = self.billing.position
        # The bills this worker appended, by position, as its appends returned them: the next
        # read takes them as they are instead of decoding them from the log again (a bill is
        # the largest event a request has, and a seventh of what a pass reads). Emptied as the
        # reads move past them.
        self._own_bills: dict[int, Recorded] = {}
        self.sweeper = LeaseSweeper(
            self.store, ttl_s=lease_ttl_s, on_expired=IdempotencyStore(engine).release_request
        )
        self.errors: dict[str, str] = {}
        self.read_position = 0  # the last position a pass read
        self._reported: tuple[Any, ...] | None = None  # the problems last written
        self._reported_at = 0.0
        # Told when a pass reads a BatchCreated (the batch runner beside the folds, if any).
        self.on_batch_created: Callable[[], None] | None = None
        # Given every read of the log (the reconciler beside the folds, which then need not
        # read it a second time).
        self.handoff: Handoff | None = None

    # --- start-up ------------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Fold the control plane, bring every fold up to the end of the log, and resume the
        sweeper from the requests that have not ended (an edge may have died with requests in
        flight)."""
        self.control_position = ControlLog(self.store, self.control).position
        for runner in self.runners:
            self._to_end(runner.name, runner.run_to_end)
            self.positions[runner.name] = runner.checkpoint()
        self._to_end(self.billing.name, self.billing.run_to_end)
        self._billing_saved = self.billing.position
        resume_sweeper(self.engine, self.store, self.sweeper)

    def _to_end(self, name: str, run_to_end: Callable[[], int]) -> None:
        """A fold's fast catch-up; one that meets an event it cannot apply stops there, and the
        passes take it from there, one event at a time where it fails (a restart must not be
        stopped by the poison event that the last run dead-lettered or was meeting)."""
        try:
            run_to_end()
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise
            log.warning("%s stopped catching up (%s); the passes go on from there", name, exc)

    @property
    def projection_position(self) -> int:
        """The lowest read model's position."""
        return min(self.positions.values())

    # --- one pass ------------------------------------------------------------------------------

    def run_pass(self, batch: int = 500) -> int:
        """Read the new events once, hand them to every fold, then sweep expired leases.
        Returns how many events were read. (The bills a pass appends are projected by the next
        pass: a pass reads the log once, before it bills.)

        The common read starts at the lowest of control, billing and the sweeper: never at a
        read model's, so a read model that is behind or failing never holds billing back. A
        read model behind that read (it failed while the others moved on) reads on its own
        until it is back in step. An event a fold cannot apply alone, twice, while the
        database answers, is dead-lettered and the fold moves past it; a database that fails
        is retried, never blamed on an event.

        Behind (after a burst, or at start-up), it folds `batch` events at a time with a short
        pause in between: on SQLite each step's write transactions hold the database's only
        write lock, which the edges' admissions wait for; 5,000 events at once held it for tens
        of milliseconds."""
        errors: dict[str, str] = {}
        read = 0
        while True:
            start = min(self.control_position, self.sweeper.position, self.billing.position)
            if not self.isolate_poison:  # the safeguard-off twin: every fold reads together
                start = min(start, self.projection_position)
            self._window_start = start
            try:
                self.tail.seek(start)
                records = self.tail.read(batch, 0, self._own_bills)
            except Exception as exc:  # the database went away: report, and read again later
                log.exception("reading the log failed")
                errors["read"] = f"{type(exc).__name__}: {exc}"
                break
            read += len(records)
            if records:
                self.read_position = max(self.read_position, records[-1].position)
                self._forget_own_bills(records[-1].position)
                if self.handoff is not None:
                    self.handoff.offer(start, records)
                faults.point("fold.after_read", position=self.read_position)
                if self.on_batch_created is not None and any(
                    r.event.EVENT_TYPE == BATCH_CREATED for r in records
                ):
                    self.on_batch_created()
            # Behind the common read: on their own (not again this pass if they failed).
            behind = [
                r for r in self.runners
                if self.positions[r.name] < start
                and r.name not in errors and "projections" not in errors
            ]  # fmt: skip
            for name, step in (
                ("control", self._follow_control),
                ("billing", self._bill_isolated),
                ("projections", self._project_isolated),
                ("sweeper", self._follow_leases),
            ):
                try:
                    step(records)
                except Exception as exc:
                    log.exception("fold %s failed", name)
                    errors[name] = f"{type(exc).__name__}: {exc}"
            if "billing" not in errors:
                try:  # a no-op when the read models' transaction carried it
                    self._save_billing_checkpoint()
                except Exception as exc:
                    log.exception("could not save the billing checkpoint")
                    errors["billing"] = f"{type(exc).__name__}: {exc}"
            # Another step while the common read or a read model's own came back full and
            # what must move for it did: a failing fold is retried at the next pass, never
            # spun on, and never holds back the others.
            pinned = {"read", "control", "billing", "sweeper"}  # the common read's start
            if not self.isolate_poison:
                pinned.add("projections")
            more = len(records) == batch and not errors.keys() & pinned
            for runner in behind:
                try:
                    more |= self._catch_up_runner(runner, batch)
                except Exception as exc:
                    log.exception("read model %s failed catching up", runner.name)
                    errors[runner.name] = f"{type(exc).__name__}: {exc}"
            if not more:
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
        for bill in self.billing.process(records, save_checkpoint=False):
            self._own_bills[bill.position] = bill

    def _forget_own_bills(self, read_to: int) -> None:
        """The bills at or before `read_to` are read: the next read starts past them (or, when a
        fold failed, reads them again from the log, as any other event)."""
        if self._own_bills:
            kept = {p: r for p, r in self._own_bills.items() if p > read_to}
            # More than that: a read stuck behind them (a fold failing) keeps them no longer.
            self._own_bills = kept if len(kept) <= OWN_BILLS_KEPT else {}

    def _bill_isolated(self, records: list[Recorded]) -> None:
        """`_bill`; when the batch fails for a reason that is not the database's, its events
        are billed one at a time and the one that still fails is dead-lettered."""
        try:
            self._bill(records)
            self._proved(self.billing.name, records, self._bills)
            return
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise
            log.warning("billing failed on a batch (%s); billing its events one at a time", exc)
        for record in records:
            if record.position <= self.billing.position:
                continue
            if not self._apply_alone(
                self.billing.name, record, lambda r=record: self._bill([r]),  # type: ignore[misc]
                lambda conn, r=record: self.checkpoints.set(self.billing.name, r.position, conn),  # type: ignore[misc]
                self._bills,
            ):
                self.billing.position = self._billing_saved = record.position

    def _project(self, records: list[Recorded]) -> None:
        """The read models in step with this read, in one transaction: rows and checkpoints
        commit together, and the billing checkpoint with them.

        The new rows are computed first, outside the write transaction: on SQLite that
        transaction holds the database's only write lock, which the edges' admissions wait for
        (computing inside it held the lock for 4-9 ms per pass at 200 req/s, measured). If
        another runner moved a checkpoint meanwhile, that projection is computed again under
        the lock."""
        runners = [r for r in self.runners if self.positions[r.name] >= self._window_start]
        if not records or not runners:
            return
        # One read transaction: the runners read their checkpoints and rows in one snapshot
        # (and, on SQLite, through the driver).
        with self.engine.connect() as conn, conn.begin():
            prepared = [runner.prepare(conn, records) for runner in runners]
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                for runner, ready in zip(runners, prepared, strict=True):
                    if ready is not None and not runner.write(conn, ready):
                        runner.apply_recorded(conn, records)
                billed = self.billing.position
                self.checkpoints.set(self.billing.name, billed, conn)
                faults.point("projections.before_commit", position=records[-1].position)
        faults.point("projections.after_commit", position=records[-1].position)
        self.metrics.observe_ledger_rows(
            (r for r in records if r.position > self.positions[LEDGER_ENTRIES.name]),
            datetime.now(UTC),
        )
        self._billing_saved = billed
        for runner in runners:
            self.positions[runner.name] = records[-1].position
            self._proved(runner.name, records, runner.touches)

    def _project_isolated(self, records: list[Recorded]) -> None:
        """`_project`; when that transaction fails for a reason that is not the database's,
        each read model applies the batch in a transaction of its own, and one that still
        fails applies it one event at a time, dead-lettering the event that fails alone. The
        batch's failure is still reported (this pass)."""
        try:
            self._project(records)
            return
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise
            failure = exc
        log.warning("the read models failed on a batch (%s); applying them apart", failure)
        for runner in self.runners:  # each on its own: one that still fails stops no other
            if self.positions[runner.name] >= self._window_start:
                try:
                    self._apply_runner(runner, records)
                except Exception as exc:
                    log.exception("read model %s failed", runner.name)
                    failure = exc
        raise failure

    def _catch_up_runner(self, runner: ProjectionRunner, batch: int) -> bool:
        """One read of its own for a read model behind the common read; True if it read a
        whole `batch` (more may follow)."""
        records = self.store.read_all(self.positions[runner.name], batch)
        self._apply_runner(runner, records)
        return len(records) == batch

    def _apply_runner(self, runner: ProjectionRunner, records: list[Recorded]) -> None:
        """`records` into one read model, in its own transaction; one at a time when that fails
        for a reason that is not the database's (the event that fails alone is dead-lettered)."""
        fresh = [r for r in records if r.position > self.positions[runner.name]]
        if not fresh:
            return
        try:
            self._write_runner(runner, fresh)
            self._proved(runner.name, fresh, runner.touches)
            return
        except Exception as exc:
            if is_transient(exc) or not self.isolate_poison:
                raise
        for record in fresh:
            self._apply_alone(
                runner.name, record,
                lambda r=record: self._write_runner(runner, [r]),  # type: ignore[misc]
                lambda conn, r=record: runner.skip(conn, r.position),  # type: ignore[misc]
                runner.touches,
            )  # fmt: skip
            self.positions[runner.name] = record.position

    def _write_runner(self, runner: ProjectionRunner, records: list[Recorded]) -> None:
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                runner.apply_recorded(conn, records)
        if runner.name == LEDGER_ENTRIES.name:
            self.metrics.observe_ledger_rows(records, datetime.now(UTC))
        self.positions[runner.name] = records[-1].position

    def _proved(
        self, fold: str, records: list[Recorded],
        touches: Callable[[Recorded], bool] | None = None,
    ) -> None:  # fmt: skip
        """`records` applied: the fold works again if one of them did something in it (an event
        the fold ignores proves nothing), so its count of dead letters in a row starts over.
        Checked only while it has one (the healthy path pays nothing)."""
        if self._in_a_row.get(fold) and (touches is None or any(map(touches, records))):
            del self._in_a_row[fold]

    @staticmethod
    def _bills(record: Recorded) -> bool:
        return record.type in TERMINAL_TYPES

    def _apply_alone(
        self, fold: str, record: Recorded, apply: Callable[[], None],
        move_past: Callable[[sa.Connection], None], touches: Callable[[Recorded], bool],
    ) -> bool:  # fmt: skip
        """Apply one event alone, in its own transaction; True if it applied. If it fails twice
        while the database answers, and not because of the database, it is dead-lettered in
        the transaction that moves the fold past it (`move_past`), and False. A transient
        failure is raised (the pass reports it and retries), as is the failure of a fold that
        already dead-lettered DEAD_LETTERS_IN_A_ROW events without applying any."""
        failure: Exception | None = None
        for _ in range(2):
            try:
                apply()
            except Exception as exc:
                if is_transient(exc):
                    raise
                failure = exc
            else:
                self._proved(fold, [record], touches)
                return True
        assert failure is not None
        if not dead_letters.database_answers(self.engine):
            raise failure
        if self._in_a_row.get(fold, 0) >= DEAD_LETTERS_IN_A_ROW:
            raise FoldBroken(
                f"{fold} failed on {DEAD_LETTERS_IN_A_ROW} events in a row; not dead-lettering "
                f"more (the fold looks broken): {dead_letters.reason_of(failure)}"
            ) from failure
        letter = DeadLetter.of(fold, record, failure)
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                dead_letters.record(conn, [letter], datetime.now(UTC))
                move_past(conn)
        self._in_a_row[fold] = self._in_a_row.get(fold, 0) + 1
        log.error(
            "%s: dead-lettered event %s at position %d (%s); moving past it",
            fold, letter.event_id, record.position, letter.reason,
        )  # fmt: skip
        return False

    def _save_billing_checkpoint(self) -> None:
        """On its own, when no read models' transaction carried it."""
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
            **process_row(self.name),
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


def run_worker(
    database_url: str, *, lease_ttl_s: float = LEASE_TTL_S, parent_pid: int = 0,
    metrics_port: int = 0, metrics_host: str = "127.0.0.1",
    batches: BatchRunnerSettings | None = None,
) -> None:
    """`tollgate worker`: catch up, then fold until SIGTERM/SIGINT (or the parent is gone); its
    /metrics on `metrics_port` (0: off); a batch runner beside the folds with `batches`."""
    engine = create_engine_from_url(database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # The billing-lag histogram only where it is served: observing every bill costs the
    # embedded worker (`tollgate serve`'s child, no /metrics of its own) ~10 us per request.
    worker = FoldWorker(
        engine, lease_ttl_s=lease_ttl_s, metrics=PipelineMetrics(billing=bool(metrics_port))
    )
    if metrics_port:
        worker.metrics.registry.register(DeadLettersCollector(engine))
    serve_metrics(metrics_port, worker.metrics.registry, metrics_host)
    worker.handoff = Handoff()
    start_reconciler(
        engine, worker.store, stop, ttl_s=lease_ttl_s, metrics=worker.metrics,
        handoff=worker.handoff,
    )  # fmt: skip
    runner = _batch_runner(engine, worker, stop, batches)
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
        delete_status_row(engine, worker.name)
        engine.dispose()


@dataclass(frozen=True, slots=True)
class BatchRunnerSettings:
    """Where the embedded batch runner sends items and how it proves itself: the edge's URL
    and token, which `tollgate serve` hands its fold worker (settings edge_url, batch_token)."""

    edge_url: str
    token: str
    concurrency: int = 8


def _batch_runner(
    engine: sa.Engine, worker: FoldWorker, stop: threading.Event,
    batches: BatchRunnerSettings | None,
) -> threading.Thread | None:
    """The batch runner beside the folds, when the edge told this worker where it is and how to
    prove itself (`tollgate serve` does)."""
    if batches is None:
        log.info("no TOLLGATE_EDGE_URL/TOLLGATE_BATCH_TOKEN: batches are not run here")
        return None
    runner = BatchRunner(
        engine, worker.store, edge_url=batches.edge_url, token=batches.token,
        concurrency=batches.concurrency,
    )
    worker.on_batch_created = runner.nudge  # idle, it polls once a second: start a new one now
    return threading.Thread(target=runner.run, args=(stop,), name="batch-runner", daemon=True)
