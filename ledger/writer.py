"""Group commit: many callers' appends share one transaction, so throughput is bounded by
rows per commit rather than commits per second."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.ledger.errors import StoreBusy, StoreError
from tollgate_llm.ledger.store import AppendBatch, AppendResult, EventStore, check_batch


class WriterClosed(StoreError):
    """submit() after close(), or after the writer stopped on an error."""


class WriterOverloaded(StoreError):
    """The queue of pending appends is full: shed load (503) instead of queueing without end."""


@dataclass(slots=True)
class _Flush:
    done: threading.Event


_STOP = object()

Committed = Callable[[list[Recorded]], None]


class Callbacks(list[Committed]):
    """The on_committed callbacks: a list, and also callable to register one (usable as a
    decorator): `writer.on_committed(fn)` is `writer.on_committed.append(fn)`."""

    def __call__(self, callback: Committed) -> Committed:
        self.append(callback)
        return callback


class GroupCommitWriter:
    """A background thread that commits submitted batches with `store.append_many`.

    It takes whatever is queued, waiting at most `max_delay_ms` after the first item for more,
    up to about `max_batch` events per commit. Each `submit` returns a Future of that batch's
    AppendResult (asyncio callers: `await asyncio.wrap_future(writer.submit(batch))`).

    After each commit, every `on_committed` callback receives the newly written records in
    position order (repeats answered from the store are not redelivered), and only then are the
    futures resolved, so a caller that sees its result knows the in-process bus has its events.

    Errors are never swallowed: if `append_many` raises, every future of that commit fails with
    the error. If a callback raises, the commit stands (its futures succeed) but the writer
    stops: queued and later submissions fail with WriterClosed, and flush()/close() re-raise.
    """

    def __init__(
        self,
        store: EventStore,
        max_batch: int = 500,
        max_delay_ms: float = 2,
        *,
        max_pending: int = 50_000,
        on_committed: list[Committed] | None = None,
    ) -> None:
        self._store = store
        self._max_batch = max_batch
        self._max_delay_s = max_delay_ms / 1000
        self.on_committed = Callbacks(on_committed or [])
        # Bounded: overload becomes a fast error, never an unbounded queue (DESIGN.md 4.6).
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._closed = False
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted, not yet committed (under _lock)
        self._commit_lock = threading.Lock()  # one commit at a time: callbacks stay in order
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def submit(self, batch: AppendBatch) -> Future[AppendResult]:
        # Check in the caller's thread, so a malformed batch is that caller's bug alone; the
        # encoding itself happens once, on the writer thread, off the request path.
        check_batch(batch)
        future: Future[AppendResult] = Future()
        with self._lock:
            if self._failure is not None:
                raise WriterClosed(f"group-commit writer stopped: {self._failure!r}")
            if self._closed:
                raise WriterClosed("group-commit writer is closed")
            try:
                self._queue.put_nowait((batch, future))
            except queue.Full:
                raise WriterOverloaded(
                    f"{self._queue.maxsize} appends already waiting to commit"
                ) from None
            self._outstanding += 1
        return future

    def commit_now(self, batches: Sequence[AppendBatch]) -> list[AppendResult] | None:
        """Commit `batches` (one transaction) in the caller's thread when that means no
        waiting: the store can try an append without blocking (SQLite), nothing submitted is
        still uncommitted, and no other connection holds the write lock. None otherwise:
        submit them instead.

        An event loop that commits its own group this way (ledger/commits.py) saves the two thread
        hand-offs of submit-and-wait (about 0.7 ms at the median, several at p99 when the GIL
        is busy); when it cannot, the batches queue here behind what is already waiting."""
        if not getattr(self._store, "can_try_append", False):
            return None
        if not self._commit_lock.acquire(blocking=False):
            return None
        try:
            with self._lock:
                if self._failure is not None or self._closed or self._outstanding:
                    return None
            try:
                results: list[AppendResult] = self._store.try_append_many(batches)  # type: ignore[attr-defined]
            except StoreBusy:
                return None
            # Nothing to sort for nobody: an edge's writer has no callbacks.
            committed = _committed(results) if self.on_committed else None
            if committed:
                try:
                    for callback in self.on_committed:
                        callback(committed)
                except BaseException as exc:
                    with self._lock:
                        self._failure = exc
            return results
        finally:
            self._commit_lock.release()

    def flush(self) -> None:
        """Return once everything submitted before this call is committed."""
        marker = _Flush(threading.Event())
        with self._lock:
            if self._closed and not self._thread.is_alive():
                self._raise_failure()
                return
            self._queue.put(marker)
        while not marker.done.wait(0.1):
            if not self._thread.is_alive():
                break
        self._raise_failure()

    def close(self) -> None:
        """Commit everything already submitted, then stop the thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._thread.join()
        self._raise_failure()

    def __enter__(self) -> GroupCommitWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise WriterClosed(f"group-commit writer stopped: {self._failure!r}") from self._failure

    # the thread

    def _run(self) -> None:
        stopping = False
        while not stopping:
            group: list[tuple[AppendBatch, Future[AppendResult]]] = []
            markers: list[_Flush] = []
            events = 0
            item = self._queue.get()
            deadline = time.monotonic() + self._max_delay_s
            while True:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, _Flush):
                    markers.append(item)
                else:
                    batch, future = item  # type: ignore[misc]
                    group.append((batch, future))
                    events += len(batch.events)
                # A flush or stop commits what it follows straight away instead of waiting.
                if stopping or markers or events >= self._max_batch:
                    break
                try:
                    remaining = deadline - time.monotonic()
                    item = (
                        self._queue.get_nowait()
                        if remaining <= 0
                        else self._queue.get(timeout=remaining)
                    )
                except queue.Empty:
                    break
            if group:
                self._commit(group)
            for marker in markers:
                marker.done.set()
            if self._failure is not None:
                self._fail_queued()
                return

    def _commit(self, group: list[tuple[AppendBatch, Future[AppendResult]]]) -> None:
        try:
            with self._commit_lock:
                self._commit_group(group)
        finally:
            with self._lock:
                self._outstanding -= len(group)

    def _commit_group(self, group: list[tuple[AppendBatch, Future[AppendResult]]]) -> None:
        live = [(b, f) for b, f in group if f.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = self._store.append_many([b for b, _ in live])
        except BaseException as exc:
            for _, future in live:
                future.set_exception(exc)
            return
        committed = _committed(results) if self.on_committed else None
        try:
            if committed:
                for callback in self.on_committed:
                    callback(committed)
        except BaseException as exc:
            with self._lock:
                self._failure = exc
        finally:
            for (_, future), result in zip(live, results, strict=True):
                future.set_result(result)

    def _fail_queued(self) -> None:
        error = WriterClosed(f"group-commit writer stopped: {self._failure!r}")
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Flush):
                item.done.set()
            elif item is not _STOP:
                _, future = item  # type: ignore[misc]
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)


def _committed(results: Sequence[AppendResult]) -> list[Recorded]:
    """The newly written records of a commit, in position order (repeats are not)."""
    return sorted(
        (r for result in results if result.ok and not result.duplicate for r in result.records),
        key=lambda r: r.position,
    )
