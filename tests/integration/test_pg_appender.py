"""The PostgreSQL store's own append connection (ledger.store.postgres.Appender): kept between
commits, replaced after the server drops it (the commit on the dropped one fails whole, the next
one succeeds), never in the way of a second appending thread, and closed with the engine."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import psycopg
import pytest
import sqlalchemy as sa

from tests.conftest import POSTGRES_URL
from tollgate_llm.domain.requests.events import FirstTokenStreamed
from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.ledger.writer import GroupCommitWriter

pytestmark = pytest.mark.postgres

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def batch(stream_id: str, expected: int | None = 0) -> AppendBatch:
    event = NewEvent(str(uuid.uuid4()), stream_id, "acme", T0, FirstTokenStreamed(stream_id, 5))
    return AppendBatch(stream_id, expected, [event])


def admin() -> psycopg.Connection:
    url = sa.make_url(POSTGRES_URL).set(drivername="postgresql")
    return psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)


def appender_pid(store: SqlEventStore) -> int:
    db = store._pg_appender._db  # the connection the last append used
    assert db is not None
    return int(db.info.backend_pid)


def alive(pid: int) -> bool:
    with admin() as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return row is not None and row[0] == 1


def test_the_connection_is_kept_between_commits(postgres_engine: sa.Engine) -> None:
    store = SqlEventStore(postgres_engine)
    store.append_many([batch("req-a")])
    pid = appender_pid(store)
    store.append_many([batch("req-b"), batch("req-a", 1)])
    assert appender_pid(store) == pid


def test_a_dropped_connection_fails_its_commit_whole_and_is_replaced(
    postgres_engine: sa.Engine,
) -> None:
    store = SqlEventStore(postgres_engine)
    store.append_many([batch("req-a")])
    pid = appender_pid(store)
    with admin() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])

    with pytest.raises(StoreUnavailable):
        store.append_many([batch("req-b"), batch("req-c"), batch("req-a", 1)])
    assert store.read_stream("req-b") == [] and store.read_stream("req-c") == []
    assert [r.stream_version for r in store.read_stream("req-a")] == [1]

    results = store.append_many([batch("req-b"), batch("req-a", 1)])
    assert all(r.ok for r in results)
    assert appender_pid(store) != pid
    assert [r.position for r in store.read_all()] == [1, 2, 3]


def test_the_writer_fails_every_waiter_of_the_dropped_commit_then_commits_again(
    postgres_engine: sa.Engine,
) -> None:
    store = SqlEventStore(postgres_engine)
    # A group closes at three events (or at a flush): the three below are one commit.
    with GroupCommitWriter(store, max_batch=3, max_delay_ms=60_000) as writer:
        first = writer.submit(batch("req-a"))
        writer.flush()
        assert first.result().ok
        with admin() as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [appender_pid(store)])
        futures = [writer.submit(batch(f"req-{i}")) for i in range(3)]
        for future in futures:
            assert isinstance(future.exception(timeout=30), StoreUnavailable)
        last = writer.submit(batch("req-z"))
        writer.flush()
        assert last.result().ok
    assert [r.stream_id for r in store.read_all()] == ["req-a", "req-z"]


def test_a_second_appending_thread_takes_a_pooled_connection(postgres_engine: sa.Engine) -> None:
    store = SqlEventStore(postgres_engine)
    store.append_many([batch("req-a")])
    pid = appender_pid(store)
    with store._pg_appender._lock:  # as while another thread's append runs on it
        assert store.append_many([batch("req-b")])[0].ok
    assert appender_pid(store) == pid
    assert [r.stream_id for r in store.read_all()] == ["req-a", "req-b"]


def test_disposing_the_engine_closes_the_connection(postgres_engine: sa.Engine) -> None:
    store = SqlEventStore(postgres_engine)
    store.append_many([batch("req-a")])
    pid = appender_pid(store)
    postgres_engine.dispose()
    assert not alive(pid)
    assert store.append_many([batch("req-b")])[0].ok  # a fresh one after


def test_a_server_that_refuses_the_connection_is_store_unavailable() -> None:
    url = sa.make_url(POSTGRES_URL).set(host="127.0.0.1", port=1)
    engine = sa.create_engine(url)  # create_engine_from_url would refuse it already
    try:
        with pytest.raises(StoreUnavailable):
            SqlEventStore(engine).append_many([batch("req-a")])
    finally:
        engine.dispose()
