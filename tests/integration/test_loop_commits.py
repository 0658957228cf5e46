"""The event loop's group commit (ledger/commits.py): what one loop iteration records shares one
transaction, lazy batches ride with it, and when the write lock is taken (or the store is
PostgreSQL) the writer thread commits the same batches in order."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tollgate_llm.domain.requests.events import FirstTokenStreamed
from tollgate_llm.ledger import schema
from tollgate_llm.ledger.commits import LoopCommits
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.ledger.writer import GroupCommitWriter

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def batch(stream_id: str, expected: int | None = 0) -> AppendBatch:
    event = NewEvent(str(uuid.uuid4()), stream_id, "acme", T0, FirstTokenStreamed(stream_id, 5))
    return AppendBatch(stream_id, expected, [event])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[SqlEventStore, GroupCommitWriter, list]]:  # noqa: E501
    url = request.getfixturevalue(f"{request.param}_url")
    schema.upgrade(url)
    engine = create_engine_from_url(url)
    store = SqlEventStore(engine)
    writer = GroupCommitWriter(store, max_delay_ms=0)
    commits: list[tuple[list[str], str]] = []
    writer.on_committed(
        lambda rs: commits.append(([r.stream_id for r in rs], threading.current_thread().name))
    )
    try:
        yield store, writer, commits
    finally:
        writer.close()
        engine.dispose()


def test_one_iteration_is_one_transaction_and_lazy_batches_ride_along(setup) -> None:  # type: ignore[no-untyped-def]
    store, writer, commits = setup

    async def main() -> None:
        loop_commits = LoopCommits(writer, lazy_delay_s=60)  # lazy ones wait for company
        ended = loop_commits.later(batch("req-ended"))
        await asyncio.sleep(0.05)
        assert not ended.done()
        results = await asyncio.gather(*(loop_commits.commit(batch(f"req-{i}")) for i in range(3)))
        assert all(r.ok for r in results) and ended.done() and ended.result().ok

    asyncio.run(main())
    assert [streams for streams, _ in commits] == [["req-ended", "req-0", "req-1", "req-2"]]
    sqlite = store.engine.dialect.name == "sqlite"
    # SQLite: committed in the loop's own thread; PostgreSQL: by the writer thread.
    assert (commits[0][1] == "MainThread") == sqlite
    assert [r.stream_id for r in store.read_all()] == ["req-ended", "req-0", "req-1", "req-2"]


def test_a_lazy_batch_alone_is_committed_after_its_delay(setup) -> None:  # type: ignore[no-untyped-def]
    store, writer, _ = setup

    async def main() -> None:
        result = await LoopCommits(writer, lazy_delay_s=0.01).later(batch("req-alone"))
        assert result.ok

    asyncio.run(main())
    assert [r.stream_id for r in store.read_all()] == ["req-alone"]


def test_a_taken_write_lock_hands_the_group_to_the_writer_thread(sqlite_url: str) -> None:
    schema.upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    store = SqlEventStore(engine)
    writer = GroupCommitWriter(store, max_delay_ms=0)
    threads: list[str] = []
    writer.on_committed(lambda rs: threads.append(threading.current_thread().name))
    other = engine.raw_connection()
    other.driver_connection.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]
    released = threading.Event()

    def release() -> None:
        time.sleep(0.2)
        other.driver_connection.execute("ROLLBACK")  # type: ignore[union-attr]
        released.set()

    async def main() -> None:
        threading.Thread(target=release).start()
        loop_commits = LoopCommits(writer)
        first, second = await asyncio.gather(
            loop_commits.commit(batch("req-a")), loop_commits.commit(batch("req-b"))
        )
        assert first.ok and second.ok and released.is_set()

    try:
        asyncio.run(main())
        assert threads and all(name == "group-commit" for name in threads)
        assert [r.stream_id for r in store.read_all()] == ["req-a", "req-b"]
    finally:
        other.close()
        writer.close()
        engine.dispose()


def test_a_refused_batch_fails_only_its_own_waiter(sqlite_url: str) -> None:
    schema.upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    store = SqlEventStore(engine)
    writer = GroupCommitWriter(store, max_delay_ms=0)
    try:

        async def main() -> None:
            loop_commits = LoopCommits(writer)
            await loop_commits.commit(batch("req-x"))
            stale, fresh = await asyncio.gather(
                loop_commits.commit(batch("req-x", expected=0)),  # req-x is at version 1
                loop_commits.commit(batch("req-y")),
            )
            assert not stale.ok and fresh.ok

        asyncio.run(main())
    finally:
        writer.close()
        engine.dispose()
