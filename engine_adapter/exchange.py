"""One chat generation as the gateway sees it: chunks arriving, the engine's last count, an end.

Engines push into it (`_deliver`, `_finish`); the gateway reads it one of two ways:

- `async for chunk in exchange` (streaming clients): one task wake-up per batch of chunks that
  arrived together, not one per chunk;
- `await exchange.run(sink)` (non-streaming clients): `sink(chunk)` is called as each chunk
  arrives, inside the engine's own callback, and the caller wakes once, at the end.

Reading is never in the consumer's task, so cancelling the consumer (a client that leaves) can not
lose a chunk the engine already sent: `last_usage` always holds the newest cumulative usage
received, including what `abort` drains after telling the engine to stop.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

Chunk = dict[str, Any]
Sink = Callable[[Chunk], None]


class ChatExchange(abc.ABC):
    """Base of the HTTP and in-process exchanges. Subclasses implement `_stop` (tell the engine to
    stop, read what it had already sent for at most `drain_s`) and `_stop_now` (drop it at once,
    without draining)."""

    __slots__ = ("last_usage", "_chunks", "_sink", "_waiter", "_ended", "_error", "_aborted")

    def __init__(self) -> None:
        self.last_usage: dict[str, Any] | None = None
        self._chunks: deque[Chunk] = deque()
        self._sink: Sink | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: BaseException | None = None
        self._aborted = False

    # --- the engine side ---------------------------------------------------------------------

    def _deliver(self, chunk: Chunk) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            self.last_usage = usage
        if self._aborted:
            return  # only the count matters now
        sink = self._sink
        if sink is None:
            self._chunks.append(chunk)
            return
        try:
            sink(chunk)
        except Exception as exc:  # noqa: BLE001 - the reader gets it, the engine is told to stop
            self._aborted = True
            self._finish(exc)
            self._stop_now()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self, error: BaseException | None) -> None:
        """The generation ended: `error` None after `[DONE]`. The first end wins."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._wake()

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

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

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
        return self._chunks.popleft()

    async def run(self, sink: Sink) -> None:
        """Hand every chunk to `sink` as it arrives and return at the end (raise its error)."""
        while self._chunks:
            sink(self._chunks.popleft())
        self._sink = sink
        while not self._ended:
            await self._wait()
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
        await self._stop(drain_s)


class IteratorExchange(ChatExchange):
    """An exchange fed by an engine's async iterator of chunks, read in a task of its own
    (the in-process engine). Stopping cancels that task, which is how such an engine is told
    to abort; every chunk it yielded was already delivered, so there is nothing to drain."""

    __slots__ = ("_task",)

    def __init__(self, chunks: AsyncIterator[Chunk]) -> None:
        super().__init__()
        self._task = asyncio.get_running_loop().create_task(self._pump(chunks))

    async def _pump(self, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                self._deliver(chunk)
                self._wake()
        except asyncio.CancelledError:
            self._finish(ConnectionAbortedError("aborted"))
            raise
        except Exception as exc:  # noqa: BLE001 - the reader gets it
            self._finish(exc)
        else:
            self._finish(None)

    def _stop_now(self) -> None:
        self._task.cancel()

    async def _stop(self, drain_s: float) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


__all__ = ["ChatExchange", "Chunk", "IteratorExchange", "Sink"]
