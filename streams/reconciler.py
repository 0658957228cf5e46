"""The continuous reconciliation (DESIGN §4 invariant 14): inside every worker, on a thread of its
own, it follows the log's lease events (admissions, renewals, terminal events) into a
`domain.gaps.GapBook`, asks the ledger which of the ended requests have their row, and writes what
is missing to `reconciliation_status`, where `tollgate status`, every edge's /readyz and /metrics
read it as alarms.

It shares nothing with the folds it checks: not their positions, not their reads, not their
process state. A billing fold that skipped a record, a consumer whose offsets moved past a batch
it never applied, a sweeper that stopped: each leaves a terminal event without its ledger row or
an admission without its terminal event, which this sees from the store, whatever the fold
believes. One reconciler runs per database (`ledger/leadership.py`); a standby only retries the
lead.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import UTC, datetime
from typing import Final

import sqlalchemy as sa

from domain.gaps import GapBook, GapReport
from domain.leases import LEASE_EVENT_TYPES, LEASE_TTL_S
from ledger import faults
from ledger.checkpoints import Checkpoints
from ledger.engine import WRITE
from ledger.finance import posted
from ledger.leadership import Leadership
from ledger.schema import reconciliation_status
from ledger.store import EventStore
from streams.metrics import PipelineMetrics
from streams.sql_tail import SqlTail

log = logging.getLogger("tollgate.reconciler")

NAME: Final = "reconciler"
EVERY_S: Final = 2.0
# Reads per step, 5,000 events each: a reconciler starting on a long log catches up over a few
# steps instead of holding one for minutes.
_READS_PER_STEP: Final = 20
_READ: Final = 5000
# Pending bills the book holds before it stops reading on: while billing is broken the pending
# set grows with the traffic, and its oldest, which the alarm is about, is already in it.
MAX_PENDING: Final = 100_000


class Reconciler:
    def __init__(
        self, engine: sa.Engine, store: EventStore, *, ttl_s: float = LEASE_TTL_S,
        metrics: PipelineMetrics | None = None, name: str = NAME,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.name = name
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.checkpoints = Checkpoints(engine)
        self.tail = SqlTail(store, engine, f"{name}-tail", event_types=LEASE_EVENT_TYPES)
        self.book = GapBook()
        self._resumed = False
        self.lead = Leadership(engine, name)
        self.last: GapReport | None = None

    def step(self, now: datetime | None = None) -> GapReport | None:
        """Fold what the log added, check the pending bills against the ledger, record the
        result. None when another worker leads."""
        if not self.lead.held():
            self._resumed = False  # a new lead folds its book again from the saved place
            return None
        if not self._resumed:
            self.book = GapBook()
            self.tail.seek(self.checkpoints.get(self.name))
            self._resumed = True
        for _ in range(_READS_PER_STEP):
            if len(self.book) >= MAX_PENDING:
                break
            records = self.tail.read(_READ, 0)
            for record in records:
                self.book.apply(record)
            if len(records) < _READ:
                break
        self.book.posted(self._posted(self.book.pending()))
        now = now or datetime.now(UTC)
        report = self.book.report(now, ttl_s=self.ttl_s)
        self._record(report, now)
        self.last = report
        if self.metrics is not None:
            self.metrics.observe_gaps(report, now)
        return report

    def _posted(self, request_ids: list[str]) -> set[str]:
        with self.engine.connect() as conn:
            return posted(conn, request_ids)

    @faults.seam("db.status")
    def _record(self, report: GapReport, now: datetime) -> None:
        row = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "checked_at": now,
            "position": self.tail.position,
            "unbilled_terminals": report.unbilled_terminals,
            "oldest_unbilled_at": report.oldest_unbilled_at,
            "overdue_leases": report.overdue_leases,
            "oldest_overdue_at": report.oldest_overdue_at,
            "sample": " ".join(report.unbilled_sample + report.overdue_sample) or None,
        }
        t = reconciliation_status
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                if not conn.execute(t.update().where(t.c.name == self.name).values(**row)).rowcount:
                    conn.execute(t.insert().values(name=self.name, **row))
                # Where a restart folds the same book from: the oldest open lease's admission
                # and the oldest pending bill, both re-read.
                self.checkpoints.set(self.name, self.book.resume_position(self.tail.position), conn)

    def run(self, stop: threading.Event, every_s: float = EVERY_S) -> None:
        while not stop.wait(every_s):
            try:
                self.step()
            except Exception:
                # Its row then ages, which is itself an alarm (streams/status.py).
                log.exception("the reconciliation failed; trying again in %.0f s", every_s)
        self.lead.release()


def start_reconciler(
    engine: sa.Engine, store: EventStore, stop: threading.Event, *,
    ttl_s: float = LEASE_TTL_S, metrics: PipelineMetrics | None = None,
) -> threading.Thread:  # fmt: skip
    """The reconciler on a daemon thread of a worker process, until `stop`."""
    reconciler = Reconciler(engine, store, ttl_s=ttl_s, metrics=metrics)
    thread = threading.Thread(target=reconciler.run, args=(stop,), name="reconciler", daemon=True)
    thread.start()
    return thread
