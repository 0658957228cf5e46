"""The fold worker: one pass bills, projects and sweeps; its heartbeat row is what the edges
report on /readyz; `tollgate worker` runs it as a process and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.batches.events import BatchCreated
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.idempotency import IdempotencyConflict, IdempotencyStore
from tollgate_llm.ledger.schema import ledger_entries, request_log, upgrade, worker_status
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.status import dead_letter_problem, read_status
from tollgate_llm.streams.worker import FoldWorker
from tollgate_llm.streams.worker_rows import read_fold_status

PRICED = "llama-3.1-8b-2026-05"
UNPRICED = "llama-3.1-70b-2026-05"
ROOT = Path(__file__).resolve().parents[2]


def _price(store: SqlEventStore) -> None:
    b.append_price(store, PRICED)


def _request(store: SqlEventStore, model: str = PRICED, *, end: bool = True) -> str:
    return b.append_request(store, model, end=end)


def test_one_pass_bills_projects_and_reports(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    done = [_request(store) for _ in range(3)]
    live = _request(store, end=False)
    worker.run_pass()  # bills the ended requests
    worker.run_pass()  # projects the bills (a pass reads the log once, before it bills)
    worker.write_status()

    with engine.connect() as conn:
        billed = {r.request_id for r in conn.execute(sa.select(ledger_entries.c.request_id))}
        statuses = dict(
            conn.execute(sa.select(request_log.c.request_id, request_log.c.status)).all()
        )
        row = conn.execute(sa.select(worker_status)).mappings().one()
    assert billed == set(done)
    assert statuses[live] == "routed" and all(statuses[r] == "completed" for r in done)
    assert row["pid"] == os.getpid() and row["error"] is None and row["dead_letters"] == 0
    assert row["billing_lag"] == 0
    assert set(worker.sweeper.leases) == {live}
    # The billing checkpoint went with the read models' transaction: a restarted worker
    # resumes billing where this one stopped.
    assert Checkpoints(engine).get("billing") == worker.billing.position == store.last_position()

    status = read_fold_status(engine, datetime.now(UTC))
    assert status.problems == () and status.warnings == ()
    # Silent for longer than the staleness limit: the edges say so.
    later = read_fold_status(engine, datetime.now(UTC) + timedelta(seconds=11))
    assert later.problems and "last reported" in later.problems[0]


def test_the_next_pass_takes_the_bills_this_worker_appended_as_they_are(
    engine: sa.Engine,
) -> None:
    """A pass reads back the bills the previous one appended: it takes the records its append
    answered instead of decoding them again, and they equal what the log holds."""
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    for _ in range(3):
        _request(store)
    reads: list[list[Recorded]] = []
    read = worker.tail.read

    def spy(*args: Any, **kwargs: Any) -> list[Recorded]:
        reads.append(read(*args, **kwargs))
        return reads[-1]

    worker.tail.read = spy  # type: ignore[method-assign]
    worker.run_pass()  # bills the three
    appended = dict(worker._own_bills)
    assert len(appended) == 3
    worker.run_pass()  # reads them back
    bills = [r for r in reads[-1] if r.type == "UsageBilled"]
    assert [r.position for r in bills] == sorted(appended)
    assert all(r is appended[r.position] for r in bills)
    assert bills == [r for r in store.read_all(0, 1000) if r.type == "UsageBilled"]
    assert worker._own_bills == {}  # read: not kept


def test_a_pass_that_reads_a_new_batch_wakes_the_batch_runner(sqlite_url: str) -> None:
    # The runner beside the folds polls once a second while no batch is open; a BatchCreated
    # read by a pass starts it at once (streams/worker.py `on_batch_created`).
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    try:
        store = SqlEventStore(engine)
        worker = FoldWorker(engine)
        worker.catch_up()
        woken: list[int] = []
        worker.on_batch_created = lambda: woken.append(worker.read_position)
        _request(store)
        worker.run_pass()
        assert woken == []  # no batch in what it read
        at = datetime.now(UTC)
        created = BatchCreated(
            "batch_1", "acme", "key-1", "file_1", "/v1/chat/completions", "24h", 2,
            at + timedelta(hours=24),
        )  # fmt: skip
        store.append("batch-batch_1", 0, [NewEvent(str(uuid.uuid4()), "batch-batch_1", "acme",
                                                   at, created)])  # fmt: skip
        worker.run_pass()
        assert woken == [store.last_position()]
    finally:
        engine.dispose()


def test_an_expired_lease_frees_its_idempotency_key(engine: sa.Engine) -> None:
    """An edge that dies mid-generation leaves its request's Idempotency-Key in flight; the
    sweeper's expiry frees it (else every retry of that key is a 409 for 24 h), and a completed
    request's replay record is kept."""
    store = SqlEventStore(engine)
    _price(store)
    keys = IdempotencyStore(engine)
    worker = FoldWorker(engine)
    worker.catch_up()
    orphan, done = _request(store, end=False), _request(store)
    keys.begin("acme", "key-orphan", orphan, "sha-1")
    keys.begin("acme", "key-done", done, "sha-2")
    keys.complete("acme", "key-done", 200, b"{}", "application/json", {})
    worker.run_pass()
    with pytest.raises(IdempotencyConflict, match="in_flight"):
        keys.lookup("acme", "key-orphan", "sha-1")  # its edge may still be generating

    assert worker.sweeper.sweep(datetime.now(UTC) + timedelta(seconds=60)) == [orphan]
    assert keys.lookup("acme", "key-orphan", "sha-1") is None  # the retry runs
    keys.begin("acme", "key-orphan", "req_retry", "sha-1")
    replay = keys.lookup("acme", "key-done", "sha-2")
    assert replay is not None and replay.request_id == done


def test_an_unbillable_request_is_a_warning_and_a_failing_fold_a_problem(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    unpriced = _request(store, UNPRICED)
    worker.run_pass()
    worker.write_status()
    status = read_fold_status(engine, datetime.now(UTC))
    assert status.problems == ()
    # Kept in the dead-letter table too (it outlives the worker), which alarms until a replay
    # bills it (DESIGN.md invariant 12).
    cluster = read_status(engine, datetime.now(UTC))
    assert cluster.dead_letters == {"billing": 1}
    assert dead_letter_problem("billing", 1) in cluster.alarms
    assert status.dead_letters == 1 and unpriced in status.warnings[0]

    def broken(records: object) -> None:
        raise RuntimeError("projection table gone")

    worker._project = broken  # type: ignore[method-assign]
    ended = _request(store)
    worker.run_pass()
    worker.write_status()  # a new problem is written at once, not at the next heartbeat
    status = read_fold_status(engine, datetime.now(UTC))
    assert any("projection table gone" in p for p in status.problems)
    # Billing went on without the read models, and its checkpoint was saved on its own.
    assert ended in {r.stream_id for r in store.read_all(0, 1000) if r.type == "UsageBilled"}
    assert Checkpoints(engine).get("billing") == worker.billing.position > 0


def test_no_report_yet_is_a_problem(engine: sa.Engine) -> None:
    status = read_fold_status(engine, datetime.now(UTC))
    assert status.problems == ("folds: no fold worker has reported yet",)


def test_tollgate_worker_runs_until_sigterm_and_folds_what_came_before(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    try:
        store = SqlEventStore(engine)
        _price(store)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tollgate_llm.cli", "worker", "--database-url", sqlite_url],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while read_fold_status(engine, datetime.now(UTC)).problems:
                assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the worker never reported"
                time.sleep(0.1)
            rid = _request(store)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out.decode()
        # The last pass after SIGTERM folded the request appended just before it.
        with engine.connect() as conn:
            billed = {r[0] for r in conn.execute(sa.select(ledger_entries.c.request_id))}
        assert rid in billed
    finally:
        engine.dispose()
