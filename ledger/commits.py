"""Group commit on the edge's event loop.

Every request records two batches: its admission, which it waits for (the engine must not see a
request whose admission is not durable), and its end, which nobody waits for. Handing each to
the writer thread and back cost two thread hand-offs per request, and with the GIL busy those
hand-offs made the admission's p99. Here the loop forms the groups itself: the admissions that
arrive in one loop iteration, plus the lazy batches (ends, rejections, lease renewals) waiting up
to `lazy_delay_s` for company, are committed together, in this thread, when that costs no
waiting (`GroupCommitWriter.commit_now`: SQLite, nothing queued, the write lock free, ~0.1 ms).
Otherwise (PostgreSQL, the fold worker holding SQLite's lock, work already queued) the same
batches go to the writer thread, in order, and its commit answers them.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future as ThreadFuture

from tollgate_llm.ledger.store import AppendBatch, AppendResult
from tollgate_llm.ledger.writer import GroupCommitWriter


class LoopCommits:
    def __init__(self, writer: GroupCommitWriter, *, lazy_delay_s: float = 0.005) -> None:
        self._writer = writer
        self._lazy_delay_s = lazy_delay_s
        self._pending: list[tuple[AppendBatch, asyncio.Future[AppendResult]]] = []
        self._flush_soon = False
        self._timer: asyncio.TimerHandle | None = None

    def commit(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        """Commit `batch` with the others of this loop iteration; await the result."""
        future = self._add(batch)
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        return future

    def later(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        """Commit `batch` with the next group, at most `lazy_delay_s` from now."""
        future = self._add(batch)
        if self._timer is None and not self._flush_soon:
            self._timer = asyncio.get_running_loop().call_later(self._lazy_delay_s, self._flush)
        return future

    def hand_over(self) -> None:
        """Give whatever waits here to the writer thread (before closing it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        self._to_thread(pending)

    def _add(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self._pending.append((batch, future))
        return future

    def _flush(self) -> None:
        self._flush_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            results = self._writer.commit_now([batch for batch, _ in pending])
        except Exception as exc:  # the store failed: every waiter hears it
            for _, future in pending:
                if not future.done():
                    future.set_exception(exc)
            return
        if results is None:
            self._to_thread(pending)
            return
        for (_, future), result in zip(pending, results, strict=True):
            if not future.done():
                future.set_result(result)

    def _to_thread(self, pending: list[tuple[AppendBatch, asyncio.Future[AppendResult]]]) -> None:
        loop = asyncio.get_running_loop()
        for batch, future in pending:
            try:
                done = self._writer.submit(batch)
            except Exception as exc:
                future.set_exception(exc)
                continue
            done.add_done_callback(lambda d, f=future: _settle_from_thread(loop, f, d))  # type: ignore[misc]


def _settle_from_thread(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[AppendResult],
    done: ThreadFuture[AppendResult],
) -> None:
    # A closed loop (shutting down) has nobody waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, done)


def _settle(future: asyncio.Future[AppendResult], done: ThreadFuture[AppendResult]) -> None:
    if future.done():
        return
    exc = done.exception()
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(done.result())
