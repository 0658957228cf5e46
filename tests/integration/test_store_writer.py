"""The group-commit writer: many threads' appends share commits, and nothing is lost,
reordered within a stream, or silently dropped."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime

import pytest

from tests.fakes import InMemoryEventStore
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.events import FirstTokenStreamed
from tollgate_llm.ledger import schema
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.store import (
    AppendBatch,
    AppendResult,
    EventStore,
    NewEvent,
    SqlEventStore,
)
from tollgate_llm.ledger.writer import GroupCommitWriter, WriterClosed

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def batch(stream_id: str, ms: int, expected: int | None = None) -> AppendBatch:
    event = NewEvent(str(uuid.uuid4()), stream_id, "acme", T0, FirstTokenStreamed(stream_id, ms))
    return AppendBatch(stream_id, expected, [event])


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest) -> Iterator[EventStore]:
    if request.param == "memory":
        yield InMemoryEventStore()
        return
    url = request.getfixturevalue(f"{request.param}_url")
    schema.upgrade(url)
    engine = create_engine_from_url(url)
    try:
        yield SqlEventStore(engine)
    finally:
        engine.dispose()


@pytest.mark.slow
def test_eight_threads_of_500_appends_all_land_in_order(store: EventStore) -> None:
    committed: list[Recorded] = []
    commits = []
    writer = GroupCommitWriter(store, max_batch=500, max_delay_ms=2)
    writer.on_committed(committed.extend)
    writer.on_committed.append(lambda records: commits.append(len(records)))
    futures: list[list[Future[AppendResult]]] = [[] for _ in range(8)]

    def work(thread: int) -> None:
        own = f"req-own-{thread}"
        for i in range(500):
            if i % 2:  # fire and forget on a shared stream
                futures[thread].append(writer.submit(batch("req-shared", thread * 1000 + i)))
            else:  # wait, then append at the exact version this thread knows
                result = writer.submit(batch(own, i, expected=i // 2)).result(timeout=30)
                assert result.ok, result.error

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()

    assert all(f.result().ok for fs in futures for f in fs)
    for thread in range(8):
        own = store.read_stream(f"req-own-{thread}")
        assert [r.stream_version for r in own] == list(range(1, 251))
        assert [r.event.ttft_ms for r in own] == list(range(0, 500, 2))  # type: ignore[attr-defined]
    shared = store.read_stream("req-shared")
    assert [r.stream_version for r in shared] == list(range(1, 2001))
    for thread in range(8):  # each thread's submissions keep their order
        mine = [r.event.ttft_ms for r in shared if r.event.ttft_ms // 1000 == thread]  # type: ignore[attr-defined]
        assert mine == sorted(mine) and len(mine) == 250
    everything = store.read_all(limit=10_000)
    assert len(everything) == 4000
    assert [r.position for r in committed] == [r.position for r in everything]  # bus order
    assert max(commits) > 1  # commits were actually shared


def test_a_conflict_fails_only_its_own_future(store: EventStore) -> None:
    with GroupCommitWriter(store) as writer:
        store.append("req-a", 0, [batch("req-a", 1).events[0]])
        stale = writer.submit(batch("req-a", 2, expected=0))
        fine = writer.submit(batch("req-b", 3, expected=0))
        writer.flush()
        assert stale.done() and fine.done()
    assert not stale.result().ok and fine.result().ok
    assert store.stream_version("req-b") == 1


class BrokenStore(InMemoryEventStore):
    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        raise StoreUnavailable("event store unavailable: connection refused")


def test_a_failed_commit_fails_every_future_of_the_batch() -> None:
    writer = GroupCommitWriter(BrokenStore(), max_delay_ms=50)
    futures = [writer.submit(batch(f"req-{i}", i)) for i in range(5)]
    writer.flush()
    for f in futures:
        with pytest.raises(StoreUnavailable):
            f.result(timeout=5)
    writer.close()  # a failed commit does not stop the writer: the next may succeed


def test_a_failing_callback_stops_the_writer_loudly() -> None:
    store = InMemoryEventStore()
    writer = GroupCommitWriter(store)

    @writer.on_committed
    def explode(records: list[Recorded]) -> None:
        raise RuntimeError("bus is down")

    first = writer.submit(batch("req-a", 1))
    assert first.result(timeout=5).ok  # the commit itself stands
    with pytest.raises(WriterClosed, match="bus is down"):
        writer.flush()
    with pytest.raises(WriterClosed):
        writer.submit(batch("req-b", 2))
    with pytest.raises(WriterClosed):
        writer.close()


def test_close_drains_everything_submitted() -> None:
    store = InMemoryEventStore()
    writer = GroupCommitWriter(store, max_batch=7, max_delay_ms=20)
    futures = [writer.submit(batch("req-a", i)) for i in range(100)]
    writer.close()
    assert all(f.done() and f.result().ok for f in futures)
    assert store.stream_version("req-a") == 100
    with pytest.raises(WriterClosed):
        writer.submit(batch("req-a", 101))


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
def test_commit_now_commits_in_the_callers_thread_only_when_that_costs_no_wait(
    backend: str, sqlite_url: str
) -> None:
    if backend == "memory":
        store: EventStore = InMemoryEventStore()
    else:
        schema.upgrade(sqlite_url)
        engine = create_engine_from_url(sqlite_url)
        store = SqlEventStore(engine)
    seen: list[tuple[str, str]] = []
    # A group waits up to a minute for company: a submitted batch stays uncommitted until flush.
    writer = GroupCommitWriter(store, max_delay_ms=60_000)
    writer.on_committed(
        lambda records: seen.extend((r.stream_id, threading.current_thread().name) for r in records)
    )
    try:
        if backend == "memory":  # no cheap non-blocking append: always the writer thread
            assert writer.commit_now([batch("req-a", 1)]) is None
            return
        results = writer.commit_now([batch("req-a", 1)])
        assert results is not None and results[0].ok
        assert seen == [("req-a", threading.current_thread().name)]
        # Something submitted and not yet committed: it must not be overtaken.
        queued = writer.submit(batch("req-b", 1))
        assert writer.commit_now([batch("req-c", 1)]) is None
        later = writer.submit(batch("req-c", 1))
        writer.flush()
        assert queued.result(timeout=0).ok and later.result(timeout=0).ok
        # Another connection holds the write lock: no waiting, nothing written.
        other = engine.raw_connection()
        try:
            other.driver_connection.execute("BEGIN IMMEDIATE")  # type: ignore[union-attr]
            assert writer.commit_now([batch("req-d", 1)]) is None
        finally:
            other.driver_connection.execute("ROLLBACK")  # type: ignore[union-attr]
            other.close()
        assert writer.commit_now([batch("req-d", 1)]) is not None
        assert [r.stream_id for r in store.read_all()] == ["req-a", "req-b", "req-c", "req-d"]
    finally:
        writer.close()
        if backend == "sqlite":
            engine.dispose()
