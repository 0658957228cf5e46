"""A streamed answer: the engine's chunks relayed as SSE frames, the answer's end held until its
terminal event is durable, a failure after the first token sent as an error object then
[DONE] (never a silently truncated answer), and a client that leaves cancelled at the engine
and billed what the engine produced. The request's ends are `api.services.flights.Flights`'.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tollgate_llm.api.ports import Idempotency
from tollgate_llm.api.services import refusal_errors
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.errors import error_frame
from tollgate_llm.api.services.flights import (
    NOT_RECORDED,
    PREEMPTED_ERRORS,
    REPLICA_ERRORS,
    Flights,
    abort_engine,
    cancel_command,
    complete_command,
    durable,
    engine_error_text,
    fail_command,
    failure_text,
    preempt_command,
)
from tollgate_llm.api.services.recorder import Flight
from tollgate_llm.api.services.retention import retention_headers
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.usage import DONE, relay_stream

__all__ = ["StreamOutcome", "StreamRelay"]


@dataclass(slots=True)
class StreamOutcome:
    headers: dict[str, str]
    frames: AsyncIterator[bytes]
    first: bytes = b""  # sent before `frames`
    # Whether the edge dropped the client (a slow reader that did not read its error either):
    # the task writing to it is cancelled then, and that is not an error.
    dropped: Callable[[], bool] = lambda: False


class StreamRelay:
    def __init__(
        self, flights: Flights, idempotency: Idempotency, *, stream_buffer_chunks: int
    ) -> None:
        self.flights = flights
        self.idempotency = idempotency
        self.stream_buffer_chunks = stream_buffer_chunks

    async def open(
        self, flight: Flight, caller: Caller, req: ChatRequest, body: dict[str, Any],
        headers: dict[str, str],
    ) -> StreamOutcome:
        flights = self.flights
        exchange: ChatExchange | None = None
        try:
            exchange = await flights.open(flight, caller, body)
            # Wait for the first chunk (it comes with the first token) so that anything that
            # fails before it still gets a real HTTP status.
            await exchange.prime()
        except BaseException as exc:
            await flights.fail(flight, caller, exchange, exc)
            error = flights.engine_failure(flight, exc, headers)
            if error is not None:
                raise error from None
            raise
        exchange.max_buffered = self.stream_buffer_chunks
        flight.owner = asyncio.current_task()
        frames = self._frames(flight, req, exchange, caller)
        # Its first frame is taken here: from then on, closing the generator (a client that
        # leaves before reading anything) runs its cancellation path.
        return StreamOutcome(headers, frames, await anext(frames), lambda: flight.dropped)

    async def _frames(
        self, flight: Flight, req: ChatRequest, exchange: ChatExchange, caller: Caller
    ) -> AsyncIterator[bytes]:
        flights = self.flights
        transcript: list[bytes] | None = [] if flight.idempotency_key else None
        held: list[bytes] = []  # the answer's end, sent once its terminal event committed
        # Frames taken while more were already buffered, sent together: one write (and one
        # system call each side) for what arrived in one read, instead of one per chunk.
        ready: list[bytes] = []
        # The engine is read in the exchange's own callbacks, not in this generator's task: a
        # client disconnect that cancels this task can never drop what the engine already sent.
        client_gone = False
        try:
            async for frame in relay_stream(
                exchange, flight.progress, include_usage=req.include_usage,
                continuous_usage=req.continuous_usage,
                on_first_token=lambda: flights.first_token(flight, stream=True),
                service_tier=flight.service_tier,
            ):
                if transcript is not None:
                    transcript.append(frame)
                if held or flight.progress.finish_reason is not None:
                    # The answer's last chunk and what follows (the final usage) wait for the
                    # terminal event's commit: a client never holds a complete answer the
                    # ledger does not know.
                    held.append(frame)
                    continue
                if not exchange.ready and _first_pending(flight):
                    await self._first_durable(flight)  # the engine may send more meanwhile
                if exchange.ready:
                    ready.append(frame)
                    continue
                if ready:
                    ready.append(frame)
                    frame = b"".join(ready)
                    ready.clear()
                yield frame
                if flight.cancel_reason is not None:
                    flights.reading(flight)
            async for frame in self._finish(flight, caller, transcript, ready, held):
                yield frame
        except PREEMPTED_ERRORS as exc:
            if flight.preempted_for is None and not isinstance(exc, REPLICA_ERRORS):
                client_gone = True  # an in-process engine's task cancelled: as below
                flights.background(self._cancel(flight, exchange, caller))
                raise
            async for frame in self._broken(flight, exchange, exc, ready):
                yield frame
        except BaseException:
            # Client gone (CancelledError from Starlette, or GeneratorExit): cancel at once. The
            # abort, the count and the terminal event run in their own task: awaits here would
            # be cancelled again before they ran.
            client_gone = True
            flights.background(self._cancel(flight, exchange, caller))
            raise
        finally:
            flights.unwatch(flight)
            if not client_gone:
                await self._release(flight, exchange, caller)

    async def _release(self, flight: Flight, exchange: ChatExchange, caller: Caller) -> None:
        """The stream is over and its client still there: the engine request is closed, and an
        Idempotency-Key it did not complete is freed for a retry."""
        await abort_engine(exchange, flight.progress)
        if flight.idempotency_key and flight.state.status != "completed":
            await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)

    async def _finish(
        self, flight: Flight, caller: Caller, transcript: list[bytes] | None,
        ready: list[bytes], held: list[bytes],
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The engine's stream ended: the frames still to coalesce (`ready`), the terminal
        event, then the held end of the answer and [DONE] once it is durable (an error object
        instead if it cannot be), and the replay kept for an Idempotency-Key."""
        if ready and not _first_pending(flight):
            yield b"".join(ready)
            ready = []
        flights, error = self.flights, flight.progress.error
        if error is not None:
            ended = flights.end(flight, fail_command(flight.progress, engine_error_text(error)))
        else:
            ended = flights.end(flight, complete_command(flight.progress))
        if ready:  # the whole answer came before a frame went: its first token rode with the end
            await self._first_durable(flight)
            yield b"".join(ready)
        if not await durable(ended):
            if flight.idempotency_key:
                await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)
            yield error_frame(NOT_RECORDED, code="not_recorded")
            yield DONE
            return
        for frame in held:
            yield frame
        if error is None and transcript is not None:
            transcript.append(DONE)
            await self.idempotency.complete(
                caller.tenant_id, flight.idempotency_key or "", 200,
                b"".join(transcript), "text/event-stream",
                {"X-Request-Id": flight.request_id, **retention_headers(flight.retention)},
            )
        yield DONE

    async def _broken(
        self, flight: Flight, exchange: ChatExchange, exc: BaseException, ready: list[bytes]
    ) -> AsyncIterator[bytes]:
        """After the first token the status is sent: what the engine sent before it broke
        (`ready`), then the failure as an error object in the stream, then [DONE], never a
        silently truncated answer. Each once the terminal event is durable (or known not to
        be: then the lease expiry bills what was renewed)."""
        flights = self.flights
        if ready and not _first_pending(flight):
            yield b"".join(ready)
            ready = []
        await abort_engine(exchange, flight.progress)  # counts what the engine reported
        if flight.preempted_for is not None:
            await durable(flights.end(flight, preempt_command(flight)))
            async for frame in self._after_end(flight, ready):
                yield frame
            yield error_frame(
                refusal_errors.PREEMPTED_MESSAGE, type="resource_unavailable", code="preempted"
            )
        elif flight.cancel_reason == "slow_reader":  # the edge stopped it: say so
            await durable(flights.end(flight, cancel_command(flight.progress, "slow_reader")))
            async for frame in self._after_end(flight, ready):
                yield frame
            yield error_frame(
                f"the stream was cancelled: the client read nothing for "
                f"{flights.slow_reader_s:g} s while its buffer was full; billed the "
                f"{flight.progress.completion_tokens} completion tokens the engine produced",
                code="slow_reader",
            )
            flights.reading(flight)
        else:
            await durable(flights.end(flight, fail_command(flight.progress, failure_text(exc))))
            async for frame in self._after_end(flight, ready):
                yield frame
            yield error_frame("the model replica failed mid-stream", code="replica_failed")
        yield DONE

    async def _after_end(self, flight: Flight, ready: list[bytes]) -> AsyncIterator[bytes]:
        """What the engine sent before it broke, when no frame had gone yet: its first token
        rode with the terminal event, which has committed (or failed to)."""
        if ready:
            await self._first_durable(flight)
            yield b"".join(ready)

    async def _first_durable(self, flight: Flight) -> None:
        """The engine's prompt count is durable before the client sees a token: a first-token
        event still staged is committed with this loop iteration's group, and waited for. (Not
        whether it was recorded: the terminal event carries the counts anyway.)"""
        if flight.first_staged:
            self.flights.recorder.flush(flight, now=True)  # sets `first_durable`
        first, flight.first_durable = flight.first_durable, None
        await durable(first)

    async def _cancel(self, flight: Flight, exchange: ChatExchange, caller: Caller) -> None:
        """Abort the engine request and bill what it sent: everything received before the
        upstream connection is closed (vLLM's abort signal) and what the abort drains."""
        await abort_engine(exchange, flight.progress)  # never raises
        self.flights.end(flight, cancel_command(flight.progress, flight.cancel_reason))
        if flight.idempotency_key:
            await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)


def _first_pending(flight: Flight) -> bool:
    """Whether the stream's first-token event is staged or committing: no frame goes before it."""
    return flight.first_staged or flight.first_durable is not None
