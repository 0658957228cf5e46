"""One chat generation as the gateway sees it: chunks arriving, the engine's last count, an end.

Engines push into it (`_deliver`, `_finish`); the gateway reads it one of two ways:

- `async for chunk in exchange` (streaming clients): one task wake-up per batch of chunks that
  arrived together, not one per chunk;
- `await exchange.run(sink)` (non-streaming clients): `sink(chunk)` is called as each chunk
  arrives, inside the engine's own callback, and the caller wakes once, at the end.

Reading is never in the consumer's task, so cancelling the consumer (a client that leaves) can not
lose a chunk the engine already sent: `last_usage` always holds the newest cumulative usage
received, including what `abort` drains after telling the engine to stop.

A streaming reader's buffer is bounded (`max_buffered` chunks): when it is full, reading from the
engine pauses until the reader has taken half of it, and `stalled_s` says for how long the reader
has taken nothing while it was full (the edge cancels a slow reader by that,
api/services/edge.py). Usage reports are still seen when reading resumes or the abort drains:
they are cumulative.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

Chunk = dict[str, Any]
Sink = Callable[[Chunk], None]

# Chunks a streaming reader may leave unread before the engine is no longer read: about one token
# each (~300 bytes with continuous usage), so ~75 KB per stream, the size of uvicorn's own write
# buffer in front of the client.
MAX_BUFFERED_CHUNKS = 256


class ChatExchange(abc.ABC):
    """Base of the HTTP and in-process exchanges. Subclasses implement `_stop` (tell the engine to
    stop, read what it had already sent for at most `drain_s`) and `_stop_now` (drop it at once,
    without draining)."""

    __slots__ = ("last_usage", "max_buffered", "_chunks", "_sink", "_waiters", "_ended", "_error",
                 "_aborted", "_paused", "_stall_from")  # fmt: skip

    def __init__(self, max_buffered: int = MAX_BUFFERED_CHUNKS) -> None:
        self.last_usage: dict[str, Any] | None = None
        self.max_buffered = max_buffered
        self._chunks: deque[Chunk] = deque()
        self._sink: Sink | None = None
        # Usually one: the reader. A preemption's abort (another task) waits beside it for the
        # end, and both must wake.
        self._waiters: list[asyncio.Future[None]] = []
        self._ended = False
        self._error: BaseException | None = None
        self._aborted = False
        self._paused = False  # the buffer is full: the engine is not being read
        self._stall_from = 0.0  # monotonic: the buffer full and nothing taken since

    # --- the engine side ---------------------------------------------------------------------

    def _deliver(self, chunk: Chunk) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            self.last_usage = usage
        if self._aborted:
            return  # only the count matters now
        sink = self._sink
        if sink is None:
            chunks = self._chunks
            chunks.append(chunk)
            if len(chunks) >= self.max_buffered and not self._paused:
                self._paused = True
                self._stall_from = time.monotonic()
                self._pause_reading()
            return
        try:
            sink(chunk)
        except Exception as exc:  # noqa: BLE001 - the reader gets it, the engine is told to stop
            self._aborted = True
            self._finish(exc)
            self._stop_now()

    def _arrived(self) -> None:
        """The engine side delivered chunks: wake a reader waiting for them. With a sink (`run`)
        they were handed on already and every waiter waits for the end only: waking it would
        resume the request's whole task once per chunk for nothing."""
        if self._sink is None:
            self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _finish(self, error: BaseException | None) -> None:
        """The generation ended: `error` None after `[DONE]`. The first end wins."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._wake()

    @abc.abstractmethod
    def _pause_reading(self) -> None:
        """Stop reading from the engine until `_resume_reading` (the reader's buffer is full)."""

    @abc.abstractmethod
    def _resume_reading(self) -> None:
        """Read from the engine again (a no-op when not paused)."""

    @abc.abstractmethod
    def _stop_now(self) -> None:
        """Drop the generation at once, without draining."""

    @abc.abstractmethod
    async def _stop(self, drain_s: float) -> None:
        """Tell the engine to stop; read what it had already sent for at most `drain_s`."""

    # --- the gateway side --------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended

    def stalled_s(self, now: float) -> float:
        """Seconds for which the buffer has been full and the reader has taken nothing (0 when
        it is not full); `now` from time.monotonic()."""
        return now - self._stall_from if self._paused and not self._ended else 0.0

    @property
    def ready(self) -> bool:
        """Whether the next read returns without waiting: a chunk is buffered, or the end is
        known. A relay sends what is ready in one write instead of one write per chunk."""
        return bool(self._chunks) or self._ended

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            self._waiters.remove(waiter)

    async def prime(self) -> None:
        """Wait for the first chunk; raise the engine's error if it ended without one."""
        while not self._chunks and not self._ended:
            await self._wait()
        if not self._chunks and self._error is not None:
            raise self._error

    def __aiter__(self) -> ChatExchange:
        return self

    async def __anext__(self) -> Chunk:
        while not self._chunks:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            await self._wait()
        chunk = self._chunks.popleft()
        if self._paused:
            self._stall_from = time.monotonic()  # the reader took one: it is slow, not gone
            if len(self._chunks) <= self.max_buffered // 2:
                self._paused = False
                self._resume_reading()
        return chunk

    async def run(self, sink: Sink) -> None:
        """Hand every chunk to `sink` as it arrives and return at the end (raise its error)."""
        while self._chunks:
            sink(self._chunks.popleft())
        self._sink = sink
        try:
            while not self._ended:
                await self._wait()
        finally:
            if self._ended:
                # Nothing is handed on after the end. The sink (a collector, which holds its
                # request, which holds this exchange) would keep a reference cycle that only the
                # garbage collector frees: ~22 objects per request, most of the edge's young
                # collections.
                self._sink = None
        if self._error is not None:
            raise self._error

    async def abort(self, drain_s: float = 1.0) -> None:
        """Stop the generation: the engine aborts it and frees its KV. What the engine had sent
        before it heard is read for at most `drain_s`, so `last_usage` is its own count of what
        it produced. No-op once ended."""
        if self._ended:
            return
        self._aborted = True
        self._chunks.clear()
        if self._paused:  # the drain must read what the engine sent meanwhile
            self._paused = False
            self._resume_reading()
        await self._stop(drain_s)


class IteratorExchange(ChatExchange):
    """An exchange fed by an engine's async iterator of chunks, read in a task of its own
    (the in-process engine). Stopping cancels that task, which is how such an engine is told
    to abort; every chunk it yielded was already delivered, so there is nothing to drain."""

    __slots__ = ("_task", "_readable")

    def __init__(
        self, chunks: AsyncIterator[Chunk], max_buffered: int = MAX_BUFFERED_CHUNKS
    ) -> None:
        super().__init__(max_buffered)
        self._readable = asyncio.Event()
        self._readable.set()
        self._task = asyncio.get_running_loop().create_task(self._pump(chunks))

    async def _pump(self, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                self._deliver(chunk)
                self._arrived()
                if not self._readable.is_set():
                    await self._readable.wait()
        except asyncio.CancelledError:
            self._finish(ConnectionAbortedError("aborted"))
            raise
        except Exception as exc:  # noqa: BLE001 - the reader gets it
            self._finish(exc)
        else:
            self._finish(None)

    def _pause_reading(self) -> None:
        self._readable.clear()

    def _resume_reading(self) -> None:
        self._readable.set()

    def _stop_now(self) -> None:
        self._task.cancel()

    async def _stop(self, drain_s: float) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


__all__ = ["MAX_BUFFERED_CHUNKS", "ChatExchange", "Chunk", "IteratorExchange", "Sink"]
