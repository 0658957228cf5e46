"""The group's lease sweeper on real PostgreSQL: one worker leads it at a time (per schema), a
worker that takes the lead from a dead leader folds the same lease book (leases, renewal instants,
progress), and the leader's expiries are the ones its successor would make."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests import builders as b
from tollgate_llm.domain.envelope import Event
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.leadership import Leadership
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.sweeper import SWEEPER_RESUME, GroupSweeper

pytestmark = [pytest.mark.postgres]

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)


@pytest.fixture
def store(postgres_engine: sa.Engine) -> SqlEventStore:
    return SqlEventStore(postgres_engine)  # the sweeper's lead is a PostgreSQL lock


def _append(store: SqlEventStore, stream: str, event: Event, seconds: float) -> None:
    version = store.stream_version(stream)
    at = T0 + timedelta(seconds=seconds)
    store.append(stream, version, [NewEvent(str(uuid.uuid4()), stream, b.TENANT, at, event)])


def admit(store: SqlEventStore, rid: str, seconds: float, edge: str = "edge-1") -> None:
    _append(store, rid, b.admitted(request_id=rid, edge_id=edge), seconds)


def renew(store: SqlEventStore, seconds: float, **completion_tokens: int) -> None:
    progress = [
        b.lease_progress(request_id=rid, completion_tokens=n)
        for rid, n in completion_tokens.items()
    ]
    _append(store, "edge-edge-2", b.renewed(*progress, edge_id="edge-2"), seconds)


def complete(store: SqlEventStore, rid: str, seconds: float) -> None:
    _append(store, rid, b.completed(request_id=rid), seconds)


def book(sweeper: GroupSweeper) -> dict[str, tuple]:
    leases = sweeper.sweeper.leases
    out = {}
    for rid in leases:
        lease = leases.get(rid)
        assert lease is not None
        progress = lease.progress.completion_tokens if lease.progress else None
        out[rid] = (lease.edge_id, lease.renewed_at, progress, lease.admitted_position)
    return out


def test_one_worker_leads_a_job_per_schema_and_hands_it_over_when_its_session_ends(
    postgres_url: str,
) -> None:
    engine = create_engine_from_url(postgres_url)
    base = make_url(postgres_url)
    other = f"t_other_{uuid.uuid4().hex[:12]}"
    conninfo = base.set(drivername="postgresql", query={}).render_as_string(hide_password=False)
    admin = psycopg.connect(conninfo, autocommit=True)
    admin.execute(f'CREATE SCHEMA "{other}"')
    other_engine = create_engine_from_url(
        base.update_query_dict({"options": f"-csearch_path={other}"}).render_as_string(
            hide_password=False
        )
    )
    first, second = Leadership(engine, "job"), Leadership(engine, "job")
    elsewhere = Leadership(other_engine, "job")
    try:
        assert first.held() and first.held()
        assert not second.held()
        assert Leadership(engine, "another-job").held()
        assert elsewhere.held()  # another deployment's schema leads its own
        first.release()
        assert second.held() and not first.held()
        # A session the server ends (a worker's connection lost) loses the lead, and another
        # worker takes it at its next try.
        assert second._conn is not None
        pid = second._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # pg_terminate_backend only signals: the lock is freed when the backend has exited.
        gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        for _ in range(200):
            if admin.execute(gone, (pid,)).fetchone() == (0,):
                break
            time.sleep(0.05)
        assert not second.held()
        assert first.held()
    finally:
        for lead in (first, second, elsewhere):
            lead.release()
        engine.dispose()
        other_engine.dispose()
        admin.execute(f'DROP SCHEMA "{other}" CASCADE')
        admin.close()


def test_a_worker_taking_the_lead_folds_the_leaders_lease_book_again(
    store: SqlEventStore,
) -> None:
    engine = store.engine
    leader = GroupSweeper(engine, store, name="worker-a")
    standby = GroupSweeper(engine, store, name="worker-b")
    assert leader.lead() and not standby.lead()  # the group's first leader: nothing in flight
    admit(store, "req-done", 0)
    admit(store, "req-long", 1)
    admit(store, "req-quiet", 2)
    renew(store, 3, **{"req-long": 40, "req-quiet": 7})
    complete(store, "req-done", 4)
    try:
        assert leader.step(T0 + timedelta(seconds=5)) == []
        assert standby.step(T0 + timedelta(seconds=5)) == [] and not standby.leading
        assert set(book(leader)) == {"req-long", "req-quiet"}
        # Its successor would start just before the oldest open lease's admission.
        oldest = book(leader)["req-long"][3]
        assert leader.checkpoints.find(SWEEPER_RESUME) == oldest - 1

        admit(store, "req-new", 6)
        renew(store, 7, **{"req-long": 90})
        leader.step(T0 + timedelta(seconds=8))
        before = book(leader)
        assert before["req-long"][1:3] == (T0 + timedelta(seconds=7), 90)
        assert before["req-quiet"][1:3] == (T0 + timedelta(seconds=3), 7)

        leader.release()  # the leader dies: its session ends
        assert standby.step(T0 + timedelta(seconds=8)) == [] and standby.leading
        assert book(standby) == before
        # And it expires what the leader would have: the quiet one, 15 s after its renewal,
        # billed the progress that renewal carried.
        assert standby.step(T0 + timedelta(seconds=18)) == ["req-quiet"]
        expired = [r for r in store.read_stream("req-quiet") if r.type == "LeaseExpired"]
        assert [r.event.completion_tokens for r in expired] == [7]  # type: ignore[attr-defined]
        assert set(book(standby)) == {"req-long", "req-new"}
    finally:
        leader.release()
        standby.release()


def test_the_groups_first_leader_starts_from_the_requests_the_read_models_show_live(
    store: SqlEventStore,
) -> None:
    from tollgate_llm.domain.projections import REQUEST_LOG
    from tollgate_llm.ledger.projections import ProjectionRunner

    admit(store, "req-old", 0)
    complete(store, "req-old", 1)
    admit(store, "req-live", 2)
    ProjectionRunner(store.engine, store, REQUEST_LOG).run_to_end()
    sweeper = GroupSweeper(store.engine, store, name="worker-a")
    try:
        assert sweeper.checkpoints.find(SWEEPER_RESUME) is None
        sweeper.step(T0 + timedelta(seconds=3))
        assert set(book(sweeper)) == {"req-live"}
    finally:
        sweeper.release()


def test_the_groups_first_leader_holds_requests_the_read_models_have_not_folded_yet(
    store: SqlEventStore,
) -> None:
    """A Kafka worker group starting while an edge already admits: its read models lag the
    store, and the requests admitted meanwhile were in neither the read model nor the log the
    leader read after it; their edge killed, they were never expired nor billed (issue 26, found
    by tests/e2e/test_edge_crash.py's distributed run). The first leader finds them in the
    store."""
    admit(store, "req-done", 0)
    complete(store, "req-done", 1)
    admit(store, "req-unfolded", 2)  # request_log never saw it
    sweeper = GroupSweeper(store.engine, store, name="worker-a")
    try:
        assert sweeper.step(T0 + timedelta(seconds=3)) == []
        assert set(book(sweeper)) == {"req-unfolded"}
        assert sweeper.step(T0 + timedelta(seconds=18)) == ["req-unfolded"]
    finally:
        sweeper.release()
