"""What the database itself guarantees about the events table, below any code path."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime

import psycopg
import pytest
import sqlalchemy as sa

from tollgate_llm.domain.requests.events import FirstTokenStreamed
from tollgate_llm.ledger import schema
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import BadDatabaseUrl, StoreUnavailable
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def new(stream_id: str) -> NewEvent:
    return NewEvent(str(uuid.uuid4()), stream_id, "acme", T0, FirstTokenStreamed(stream_id, 5))


@pytest.mark.parametrize(
    "statement",
    ["UPDATE events SET payload = '{}'", "DELETE FROM events", "UPDATE events SET position = 99"],
)
def test_the_database_refuses_to_change_events(store: SqlEventStore, statement: str) -> None:
    store.append("req-1", 0, [new("req-1")])
    with pytest.raises(sa.exc.DatabaseError, match="append-only"), store.engine.begin() as conn:
        conn.exec_driver_sql(statement)
    assert len(store.read_stream("req-1")) == 1


@pytest.mark.postgres
def test_postgres_refuses_to_truncate_events(postgres_url: str) -> None:
    schema.upgrade(postgres_url)
    engine = create_engine_from_url(postgres_url)
    try:
        store = SqlEventStore(engine)
        store.append("req-1", 0, [new("req-1")])
        with pytest.raises(sa.exc.DatabaseError, match="append-only"), engine.begin() as conn:
            conn.exec_driver_sql("TRUNCATE events")
        assert store.last_position() == 1
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_tailing_reader_never_skips_an_event_that_commits_late(postgres_url: str) -> None:
    """An append holds the events table's write lock until it commits, so a second append cannot
    take a position (and become visible) before the first one is visible."""
    schema.upgrade(postgres_url)
    engine = create_engine_from_url(postgres_url)
    conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        store = SqlEventStore(engine)
        with psycopg.connect(conninfo) as first:
            # An append in progress: it holds the lock and has not committed yet.
            first.execute("LOCK TABLE events IN EXCLUSIVE MODE")
            done = threading.Event()
            worker = threading.Thread(
                target=lambda: (store.append("req-late", 0, [_first_token("req-late")]),
                                done.set()),
            )
            worker.start()
            assert not done.wait(0.5)  # the second append waits for the first to commit
            assert store.read_all() == []
            first.commit()
            worker.join(10)
        assert [r.stream_id for r in store.read_all()] == ["req-late"]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_long_transaction_elsewhere_does_not_stall_tailing_readers(postgres_url: str) -> None:
    """A transaction left open in another database of the same server (a bulk load, an
    analyst's session) must not hide newly committed events from the folds."""
    schema.upgrade(postgres_url)
    engine = create_engine_from_url(postgres_url)
    other = engine.url.set(drivername="postgresql", database="postgres", query={})
    try:
        store = SqlEventStore(engine)
        with psycopg.connect(other.render_as_string(hide_password=False)) as idle:
            idle.execute("SELECT pg_current_xact_id()")  # holds back the cluster's xmin
            store.append("req-now", 0, [_first_token("req-now")])
            assert [r.stream_id for r in store.read_all()] == ["req-now"]
            assert store.last_position() == 1
    finally:
        engine.dispose()


def _first_token(request_id: str) -> NewEvent:
    return NewEvent(str(uuid.uuid4()), request_id, "acme", datetime.now(UTC),
                    FirstTokenStreamed(request_id, 1))


def test_bad_urls_and_absent_databases_fail_with_one_line(tmp_path: object) -> None:
    with pytest.raises(BadDatabaseUrl, match="malformed database URL"):
        create_engine_from_url("not a url")
    with pytest.raises(BadDatabaseUrl, match="unsupported database URL scheme 'mysql'"):
        create_engine_from_url("mysql://localhost/x")
    with pytest.raises(BadDatabaseUrl, match="in-memory"):
        create_engine_from_url("sqlite://")
    with pytest.raises(StoreUnavailable, match="does not exist"):
        create_engine_from_url("sqlite:////nonexistent-dir/x/tollgate.db")
    with pytest.raises(
        StoreUnavailable, match=r"cannot reach postgresql\+psycopg://u:\*\*\*@127.0.0.1:1/x"
    ):
        create_engine_from_url("postgresql://u:secret@127.0.0.1:1/x")
