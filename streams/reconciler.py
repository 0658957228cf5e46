"""The continuous reconciliation (DESIGN §4 invariant 14): inside every worker, on a thread of its
own, it follows the log's lease events (admissions, renewals, terminal events) into a
`domain.gaps.GapBook`, asks the ledger which of the ended requests have their row, and writes what
is missing to `reconciliation_status`, where `tollgate status`, every edge's /readyz and /metrics
read it as alarms.

It shares nothing with the folds it checks: not their positions, not their process state. A
billing fold that skipped a record, a consumer whose offsets moved past a batch it never applied,
a sweeper that stopped: each leaves a terminal event without its ledger row or an admission
without its terminal event, which this sees from the store, whatever the fold believes. One
reconciler runs per database (`ledger/leadership.py`); a standby only retries the lead.

Beside the embedded fold worker it takes that worker's reads of the log (`Handoff`) instead of
reading the log a second time (13 % of the worker's CPU, bench/overhead.md): a read is a range of
positions read whole, and it is folded only where it continues the reconciler's own position, so
the reconciler never moves past a position it has not seen read; anything else (a gap, a fold
that rewound, more than the handoff holds) and it reads the store itself, as without a worker.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

import sqlalchemy as sa

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.gaps import GapBook, GapReport
from tollgate_llm.domain.leases import LEASE_EVENT_TYPES, LEASE_TTL_S
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.engine import WRITE
from tollgate_llm.ledger.finance import posted
from tollgate_llm.ledger.leadership import Leadership
from tollgate_llm.ledger.schema import reconciliation_status
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.streams.metrics import PipelineMetrics
from tollgate_llm.streams.sql_tail import SqlTail

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
# The worker's reads a handoff holds: a pass every 0.1 s, a few reads each under load, against a
# reconciliation every 2 s.
_HANDED_READS_MAX: Final = 256


class Handoff:
    """The fold worker's reads, offered to the reconciler of its process: each the records of
    positions (`after`, last record's] read whole, oldest first. Bounded: a reconciler that does
    not take them (a standby, or one stuck on the database) loses the oldest, and its next read
    from the handoff finds the gap and reads the store instead."""

    def __init__(self, max_reads: int = _HANDED_READS_MAX) -> None:
        self._reads: deque[tuple[int, list[Recorded]]] = deque(maxlen=max_reads)

    def offer(self, after: int, records: list[Recorded]) -> None:
        """From the worker's thread: `records`, all the log holds after `after` up to the last."""
        if records:
            self._reads.append((after, records))

    def take(self, position: int, fold: Callable[[Recorded], None]) -> int:
        """Fold the lease events of the reads that continue `position`, in order; the position
        the reads took it to (`position` itself at the first gap, where the store is read)."""
        reads = self._reads
        while reads:
            after, records = reads[0]
            if after > position:
                break  # a gap: the reads on from here wait until the store's read reaches them
            reads.popleft()
            if records[-1].position <= position:
                continue  # read already
            for record in records:
                if record.position > position and record.type in LEASE_EVENT_TYPES:
                    fold(record)
            position = records[-1].position
        return position

    def clear(self) -> None:
        self._reads.clear()


class Reconciler:
    def __init__(
        self, engine: sa.Engine, store: EventStore, *, ttl_s: float = LEASE_TTL_S,
        metrics: PipelineMetrics | None = None, name: str = NAME, handoff: Handoff | None = None,
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
        self.handoff = handoff

    def step(self, now: datetime | None = None) -> GapReport | None:
        """Fold what the log added, check the pending bills against the ledger, record the
        result. None when another worker leads."""
        handoff = self.handoff
        if not self.lead.held():
            self._resumed = False  # a new lead folds its book again from the saved place
            if handoff is not None:
                handoff.clear()
            return None
        if not self._resumed:
            self.book = GapBook()
            self.tail.seek(self.checkpoints.get(self.name))
            self._resumed = True
        if handoff is not None:
            self.tail.seek(handoff.take(self.tail.position, self.book.apply))
        for _ in range(_READS_PER_STEP):
            if len(self.book) >= MAX_PENDING:
                break
            records = self.tail.read(_READ, 0)
            for record in records:
                self.book.apply(record)
            if len(records) < _READ:
                break
        if handoff is not None:  # what the worker read while this read the store
            self.tail.seek(handoff.take(self.tail.position, self.book.apply))
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
    handoff: Handoff | None = None,
) -> threading.Thread:  # fmt: skip
    """The reconciler on a daemon thread of a worker process, until `stop`; fed the worker's
    reads through `handoff` when the worker reads the whole log."""
    reconciler = Reconciler(engine, store, ttl_s=ttl_s, metrics=metrics, handoff=handoff)
    thread = threading.Thread(target=reconciler.run, args=(stop,), name="reconciler", daemon=True)
    thread.start()
    return thread
