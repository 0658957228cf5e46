"""The continuous reconciliation (streams/reconciler.py): billing broken on purpose — a request
priced for no model, so the billing fold cannot bill it, and an admission whose edge died with no
sweeper running — alarms in `read_status` (what /readyz and `tollgate status` show), on the
worker's /metrics and through `tollgate status`'s exit code; fixed, the alarms clear. The
reconciler reads the store, not the folds' own belief, and resumes where it left off."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.schema import ledger_entries
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.metrics import PipelineMetrics
from tollgate_llm.streams.reconciler import Handoff, Reconciler
from tollgate_llm.streams.status import read_status
from tollgate_llm.streams.worker import FoldWorker

PRICED, UNPRICED = b.PRICED, b.UNPRICED
_price, _request = b.append_price, b.append_request


def _fold(worker: FoldWorker) -> None:
    worker.run_pass()  # bills
    worker.run_pass()  # projects the bills into the ledger
    worker.write_status(every_s=0)


def test_billing_broken_on_purpose_alarms_and_the_alarm_clears(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine, lease_ttl_s=3600)  # a sweeper that never expires: "stopped"
    worker.catch_up()
    billed = [_request(store) for _ in range(3)]
    # Broken on purpose: no price for this model, so billing dead-letters its terminal event and
    # it gets no ledger row; and an admission 40 s old that no edge renews and no sweeper ends.
    unbillable = _request(store, UNPRICED)
    orphan = _request(store, end=False, age_s=40)
    _fold(worker)
    with engine.connect() as conn:
        rows = set(conn.execute(sa.select(ledger_entries.c.request_id)).scalars())
    assert set(billed) <= rows and unbillable not in rows

    metrics = PipelineMetrics(billing=False)
    reconciler = Reconciler(engine, store, metrics=metrics)
    now = datetime.now(UTC)
    report = reconciler.step(now)
    assert report is not None
    assert report.unbilled_terminals == 1 and report.unbilled_sample == (unbillable,)
    assert report.overdue_leases == 1 and report.overdue_sample == (orphan,)

    # Fresh, the unbilled terminal is lag, not yet an alarm; the overdue lease is one at once.
    fresh = read_status(engine, now, unbilled_alarm_s=30)
    # (The refused bill is a dead letter of the billing fold: an alarm at once.)
    assert [a.split(":")[0] for a in fresh.alarms] == ["leases", "dead letters"]
    assert orphan in fresh.alarms[0]
    # 40 s later the unbilled terminal is past its 30 s too, and the reconciliation's own row,
    # unrefreshed, is stale while the log has moved on.
    _request(store)
    later = read_status(engine, now + timedelta(seconds=40), unbilled_alarm_s=30)
    kinds = [a.split(":")[0] for a in later.alarms]
    assert kinds == ["billing", "leases", "reconciliation", "dead letters"]
    assert "1 terminal event(s) without a ledger row" in later.alarms[0]
    assert unbillable in later.alarms[0]
    assert later.problems == later.stale + later.alarms

    # The worker's /metrics carry the same figures, their ages growing until cleared.
    sample = {
        s.name: s.value for m in metrics.registry.collect() for s in m.samples
    }  # fmt: skip
    assert sample["tollgate_unbilled_terminals"] == 1
    assert sample["tollgate_overdue_leases"] == 1
    assert sample["tollgate_unbilled_terminal_oldest_age_seconds"] >= 0
    assert sample["tollgate_overdue_lease_oldest_age_seconds"] >= 40

    # A restarted reconciler folds the same book from where this one saved its place (the
    # request appended since is billed first, so only the broken ones are pending).
    # One reconciler leads per database: the first hands the lead over, as a dying one does.
    _fold(worker)
    reconciler.lead.release()
    successor = Reconciler(engine, store)
    again = successor.step(now)
    assert again is not None
    assert again.unbilled_sample == (unbillable,) and again.overdue_sample == (orphan,)
    successor.lead.release()

    # Fixed: a price for the model and a sweeper that expires; the folds catch up, and the
    # alarms clear.
    at = datetime.now(UTC) - timedelta(days=1)
    new = NewEvent(
        str(uuid.uuid4()), f"prices-{UNPRICED}", "", at,
        PriceSet(UNPRICED, 150_000, 600_000, 0, at),
    )  # fmt: skip
    store.append(new.stream_id, 0, [new])
    # Billing run again from the start (bills are idempotent: only the missing one is added).
    Checkpoints(engine).set("billing", 0)
    fixed = FoldWorker(engine, lease_ttl_s=15)
    fixed.catch_up()
    _fold(fixed)
    _fold(fixed)
    report = reconciler.step()
    assert report is not None
    assert (report.unbilled_terminals, report.overdue_leases) == (0, 0)
    assert read_status(engine, datetime.now(UTC), unbilled_alarm_s=30).alarms == ()


def test_tollgate_status_exits_2_on_an_alarm(url: str, engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine, lease_ttl_s=3600)
    worker.catch_up()
    unbillable = _request(store, UNPRICED, age_s=5)
    _fold(worker)
    Reconciler(engine, store).step()

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tollgate_llm.cli", "status", "--database-url", url, *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    calm = status("--unbilled-alarm-after", "60")
    assert "UNBILLED TERMINALS" in calm.stdout
    # Exit 2 only for the billing fold's dead letter (the refused bill), not yet for the gap.
    assert calm.returncode == 2 and "dead letters: billing" in calm.stdout
    assert "billing: 1 terminal event(s)" not in calm.stdout
    paged = status("--unbilled-alarm-after", "1")
    assert paged.returncode == 2, paged.stdout + paged.stderr
    assert "ALARMS:" in paged.stdout and unbillable in paged.stdout
    assert "billing: 1 terminal event(s)" in paged.stdout


def _counting_store_reads(reconciler: Reconciler) -> list[int]:
    """How many records each of the reconciler's own reads of the store returned."""
    counts: list[int] = []
    read = reconciler.tail.read

    def counted(max_records: int = 500, timeout_s: float = 0.5) -> list[Any]:
        records = read(max_records, timeout_s)
        counts.append(len(records))
        return records

    reconciler.tail.read = counted  # type: ignore[method-assign]
    return counts


def test_fed_the_workers_reads_it_reads_the_log_once_and_finds_the_same_gaps(
    engine: sa.Engine,
) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine, lease_ttl_s=3600)
    worker.catch_up()
    handoff = Handoff()
    worker.handoff = handoff
    reconciler = Reconciler(engine, store, handoff=handoff)
    own_reads = _counting_store_reads(reconciler)
    assert reconciler.step() is not None  # resumes at the log's start: reads the store itself
    started = len(own_reads)

    billed = [_request(store) for _ in range(3)]
    unbillable = _request(store, UNPRICED)
    orphan = _request(store, end=False, age_s=40)
    _fold(worker)
    report = reconciler.step()
    assert report is not None
    assert report.unbilled_sample == (unbillable,) and report.overdue_sample == (orphan,)
    # Everything came from the worker's reads: the reconciler's own read found the end.
    assert sum(own_reads[started:]) == 0
    assert billed  # billed, so not pending
    # The same book as a reconciler that reads the store alone.
    reconciler.lead.release()
    alone = Reconciler(engine, store, name="reconciler-alone").step()
    assert alone is not None
    assert (alone.unbilled_sample, alone.overdue_sample) == (
        report.unbilled_sample, report.overdue_sample,
    )  # fmt: skip


def test_a_read_missing_from_the_handoff_is_read_from_the_store(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine, lease_ttl_s=3600)
    worker.catch_up()
    handoff = Handoff()
    reconciler = Reconciler(engine, store, handoff=handoff)
    assert reconciler.step() is not None
    own_reads = _counting_store_reads(reconciler)
    # The worker's read of the unbillable request never reaches the handoff (a worker that
    # moved past it, or a handoff that dropped it): the reads after it leave a gap.
    unbillable = _request(store, UNPRICED)
    _fold(worker)
    worker.handoff = handoff
    _request(store)
    _fold(worker)
    report = reconciler.step()
    assert report is not None and report.unbilled_sample == (unbillable,)
    assert sum(own_reads) > 0  # the gap was read from the store


def test_a_bounded_handoff_drops_its_oldest_reads_and_the_gap_is_seen() -> None:
    handoff = Handoff(max_reads=2)
    first, second, third = (
        b.stream(b.admitted(request_id=f"r{i}"), start=i) for i in (1, 2, 3)
    )  # positions 1, 2 and 3, one lease event each
    handoff.offer(0, first)
    handoff.offer(1, second)
    handoff.offer(2, third)  # the first read is dropped
    folded: list[str] = []
    assert handoff.take(0, lambda r: folded.append(r.stream_id)) == 0  # the gap: nothing taken
    assert folded == []
    # Once the store's read reached position 1, the rest continue it.
    assert handoff.take(1, lambda r: folded.append(r.stream_id)) == 3
    assert folded == ["r2", "r3"]
