"""The requests admitted on this edge, from their admission until each ends with exactly one
terminal event: the engine request opened where a preemption can reach it, the first token
recorded, flex work preempted (for this edge's router or another edge's ask), slow readers
cancelled and dropped, the leases renewed, and `end`, the one place a request ends (terminal
event, then `Admission.settle`: refund and release).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import Clock, Idempotency
from tollgate_llm.api.services import refusal_errors
from tollgate_llm.api.services.admission import Admission
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.outcomes import Outcomes, Terminal
from tollgate_llm.api.services.recorder import Flight, Recorder
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.decide import (
    CancelRequest,
    CompleteRequest,
    FailRequest,
    PreemptRequest,
    RecordFirstToken,
)
from tollgate_llm.domain.requests.events import PreemptionRequested
from tollgate_llm.domain.types import CancelReason
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.usage import Progress
from tollgate_llm.engine_adapter.vllm_http import (
    ReplicaHTTPError,
    ReplicaStreamBroken,
    ReplicaUnavailable,
)
from tollgate_llm.ledger.store import AppendResult

__all__ = [
    "NOT_RECORDED", "PREEMPTED_ERRORS", "REPLICA_ERRORS", "Flights", "Preempted", "abort_engine",
    "cancel_command", "committed", "complete_command", "durable", "engine_error_text",
    "fail_command", "failure_text", "preempt_command",
]

log = logging.getLogger("tollgate.edge")

REPLICA_ERRORS = (ReplicaHTTPError, ReplicaUnavailable, ReplicaStreamBroken)


class Flights:
    def __init__(
        self, *, admission: Admission, recorder: Recorder, outcomes: Outcomes, metrics: Metrics,
        idempotency: Idempotency, clock: Clock, edge_id: str, slow_reader_s: float,
        retry_after_s: Callable[[], int],
    ) -> None:  # fmt: skip
        self.admission = admission
        self.recorder = recorder
        self.outcomes = outcomes
        self.metrics = metrics
        self.idempotency = idempotency
        self.clock = clock
        self.edge_id = edge_id
        self.slow_reader_s = slow_reader_s  # 0: slow readers are never cancelled
        self.retry_after_s = retry_after_s  # a Retry-After for a refusal by the engine
        self.in_flight: dict[str, Flight] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Slow readers cancelled at the engine, whose client is dropped if it still reads
        # nothing by the deadline (monotonic).
        self._stalled: dict[str, tuple[Flight, float]] = {}

    # --- the engine request ---------------------------------------------------------------------

    async def open(self, flight: Flight, caller: Caller, body: dict[str, Any]) -> ChatExchange:
        """Open the engine request, where a preemption can reach it. A flex request preempted
        while it was being opened is aborted at once (it raises `Preempted`)."""
        trace = flight.trace
        exchange = await flight.choice.replica.open_chat(
            body, request_id=flight.request_id, cache_salt=caller.cache_salt,
            traceparent=None if trace is None else trace.engine_opened(flight.choice.replica_id),
        )  # fmt: skip
        flight.exchange = exchange
        if flight.preempted_for is not None:
            await abort_engine(exchange, flight.progress)
            raise Preempted(flight.preempted_for)
        return exchange

    def engine_failure(
        self, flight: Flight, exc: BaseException, headers: dict[str, str]
    ) -> ApiError | None:
        """What the client gets for an engine request that broke before the answer started
        (None: the exception itself, re-raised)."""
        if flight.preempted_for is not None and isinstance(exc, PREEMPTED_ERRORS):
            return refusal_errors.preempted(self.retry_after_s(), headers)
        if isinstance(exc, REPLICA_ERRORS):
            return self._replica_error(exc, headers)
        return None

    def _replica_error(self, exc: BaseException, headers: dict[str, str]) -> ApiError:
        if isinstance(exc, ReplicaHTTPError) and 400 <= exc.status < 500 and exc.status != 429:
            err = exc.body.get("error", {}) if isinstance(exc.body, dict) else {}
            err = err if isinstance(err, dict) else {}
            return ApiError(
                exc.status, str(err.get("message") or exc), param=err.get("param"),
                code="engine_rejected", headers=headers,
            )
        return refusal_errors.replica_unavailable(self.retry_after_s(), headers)

    def first_token(self, flight: Flight, stream: bool = False) -> None:
        """The first chunk arrived: record its instant and the engine's prompt counts (its
        continuous usage stats), which a lease expiry bills at least from then on.

        Either way it is staged. A stream's commits before its first frame is sent, with this
        loop iteration's group (`api.services.relay`): a client that saw a token is billed at
        least its prompt whatever happens to this edge next. When the engine's whole answer is
        read before a frame goes (an engine that answers at once), it commits with the terminal
        event instead: one commit for the two, and the frames wait for it. A non-streamed
        request's goes with the next lease renewal (0.1 s) or its terminal event, saving a
        commit per request."""
        p = flight.progress
        exchange = flight.exchange
        if exchange is not None and exchange.last_usage is not None:
            p.absorb_usage(exchange.last_usage)
        ttft_ms = p.ttft_ms
        self.metrics.ttft_of(flight.model).observe(ttft_ms / 1000)
        command = RecordFirstToken(
            ttft_ms=ttft_ms, prompt_tokens=p.prompt_tokens,
            cached_tokens=min(p.cached_tokens, p.prompt_tokens),
        )  # fmt: skip
        self.recorder.stage(flight, command)
        flight.first_staged = stream

    # --- the end of a request ---------------------------------------------------------------

    def track(self, flight: Flight) -> None:
        """An admitted request is in flight on this edge until `end`."""
        self.in_flight[flight.request_id] = flight
        self.metrics.in_flight.inc()
        self.metrics.admitted_of(flight.tier, flight.model).inc()

    def end(self, flight: Flight, command: Terminal) -> asyncio.Future[bool] | None:
        """The one place a request ends on this edge: terminal event, refund, release. Returns
        whether the terminal event became durable, as a future (`durable`), for what must not
        reach the client before it: the final usage, [DONE], a JSON body."""
        if flight.finished:
            return flight.ended
        if flight.preempted_for is not None and not isinstance(command, PreemptRequest):
            # Whatever path noticed the abort first (the stream breaking, the preemption's own
            # task), a preempted request ends preempted, with the engine's counts.
            command = preempt_command(flight)
        flight.finished = True
        p = flight.progress
        if isinstance(command, CompleteRequest) and p.tpot_us:
            self.metrics.tpot_of(flight.model).observe(p.tpot_us / 1e6)
        try:
            # `now`: the answer's end (the JSON body, the final usage, [DONE]) waits for this
            # commit, so it goes with this loop iteration's group, not the lazy one (up to 5 ms
            # more per answer: at one connection, most of the edge's added latency).
            flight.ended = self.recorder.record(flight, command, now=True)
        finally:
            if flight.trace is not None:
                flight.trace.ended(flight.progress, TERMINAL_LABEL[type(command)], flight.ended)
            self.admission.settle(flight, command)
            if self.in_flight.pop(flight.request_id, None) is not None:
                self.metrics.in_flight.dec()
            status = TERMINAL_LABEL[type(command)]
            self.metrics.finished_of(status).inc()
            admitted_at = flight.state.admitted_at or self.clock()
            self.outcomes.count(
                flight.tenant_id, flight.tier, flight.model, status, admitted_at, command
            )
        return flight.ended

    async def fail(
        self, flight: Flight, caller: Caller, exchange: ChatExchange | None, exc: BaseException
    ) -> None:
        """End a request whose generation broke before it could answer: abort first (it reads
        what the engine already sent, which is billed), then the terminal event, then free its
        Idempotency-Key (nothing to replay: the client's retry must be able to run)."""
        await abort_engine(exchange, flight.progress)
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cancelled:
            self.end(flight, cancel_command(flight.progress))
        elif isinstance(exc, REPLICA_ERRORS):
            self.end(flight, fail_command(flight.progress, failure_text(exc)))
        elif isinstance(exc, Preempted):
            self.end(flight, preempt_command(flight))
        else:
            self.end(flight, fail_command(flight.progress, f"edge error: {type(exc).__name__}"))
        key = flight.idempotency_key
        if key is not None:
            abandon = self.idempotency.abandon(caller.tenant_id, key)
            if cancelled:  # this task is being cancelled: an await here could be cut short
                self.background(abandon)
            else:
                await abandon

    # --- flex preemption ----------------------------------------------------------------------

    def preempt(self, request_ids: tuple[str, ...], for_request_id: str) -> None:
        """Abort these flex requests at their engine, for `for_request_id`: each ends with
        RequestPreempted and the engine's counts (refunded in full, billed nothing); its client
        gets `resource_unavailable`/`preempted` (in the stream, or as a 429 before it). A request
        that already ended, or is not flex, is left alone."""
        for request_id in request_ids:
            flight = self.in_flight.get(request_id)
            if flight is None or flight.finished or flight.service_tier != "flex":
                continue
            if flight.preempted_for is not None:
                continue
            exchange = flight.exchange
            if exchange is not None and exchange.ended:
                continue  # it finished: its own path completes it
            flight.preempted_for = for_request_id
            self.metrics.flex_of(flight.model, flight.tier, "preempted").inc()
            if exchange is not None:  # else `_open` aborts it as soon as it is opened
                self.background(self._preempt(flight, exchange))

    def preemption_requested(self, record: Recorded) -> None:
        event = record.event
        assert isinstance(event, PreemptionRequested)
        flight = self.in_flight.get(event.request_id)
        if flight is None or event.requested_by == self.edge_id:
            return  # not served here (or over): its own edge, or nobody, answers it
        self.recorder.observed(flight, record)
        self.preempt((event.request_id,), event.preempted_for)

    async def _preempt(self, flight: Flight, exchange: ChatExchange) -> None:
        await abort_engine(exchange, flight.progress)  # the engine's count of what it had done
        self.end(flight, preempt_command(flight))

    # --- slow readers -------------------------------------------------------------------------

    def check_slow_readers(self, now: float) -> None:
        """Cancel at the engine every stream whose client has read nothing for `slow_reader_s`
        with its buffer full (Seed 004: slow clients must not pin resources): the engine stops,
        its KV is freed, and the request is billed what the engine produced. The client gets an
        error object and [DONE] when it reads again; if it still reads nothing `slow_reader_s`
        later, its connection is dropped. `now` from time.monotonic(); called every 0.5 s
        (api/runtime.py), so a slow reader is cancelled within `slow_reader_s` + 0.5 s of its
        buffer filling."""
        limit = self.slow_reader_s
        if limit <= 0:
            return
        for flight in list(self.in_flight.values()):
            exchange = flight.exchange
            if (
                exchange is None
                or flight.cancel_reason is not None
                or flight.preempted_for is not None
                or exchange.stalled_s(now) < limit
            ):
                continue
            flight.cancel_reason = "slow_reader"
            self.metrics.slow_readers.inc()
            self._stalled[flight.request_id] = (flight, now + limit)
            self.background(self._cancel_slow_reader(flight, exchange))
        for request_id, (flight, deadline) in list(self._stalled.items()):
            if now < deadline:
                continue
            del self._stalled[request_id]
            owner = flight.owner
            if owner is not None and not owner.done():
                flight.dropped = True
                self.metrics.slow_readers_dropped.inc()
                owner.cancel()

    def reading(self, flight: Flight) -> None:
        """A cancelled slow reader took a frame: it is not dropped before another timeout."""
        if flight.request_id in self._stalled:
            self._stalled[flight.request_id] = (flight, time.monotonic() + self.slow_reader_s)

    def unwatch(self, flight: Flight) -> None:
        """Its stream is over: no slow reader to drop any more."""
        self._stalled.pop(flight.request_id, None)

    async def _cancel_slow_reader(self, flight: Flight, exchange: ChatExchange) -> None:
        await abort_engine(exchange, flight.progress)  # never raises; drains the engine's count
        self.end(flight, cancel_command(flight.progress, "slow_reader"))

    def background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)



# What a client gets instead of an answer whose terminal event could not be recorded (the event
# store stayed away, or the request had been ended meanwhile, by its lease expiry): the ledger's
# bill is then what the edge had renewed, never what this answer would have said.
NOT_RECORDED = "the answer could not be recorded, so it is not sent; retry later"

TERMINAL_LABEL: dict[type, str] = {
    CompleteRequest: "completed",
    CancelRequest: "cancelled",
    FailRequest: "failed",
    PreemptRequest: "preempted",
}


class Preempted(Exception):
    """A flex request was preempted before its engine request was opened."""



# What a flex request's path sees when its preemption aborts the engine request (an in-process
# engine's exchange ends with ConnectionAbortedError).
PREEMPTED_ERRORS = (*REPLICA_ERRORS, Preempted, ConnectionAbortedError)


def preempt_command(flight: Flight) -> PreemptRequest:
    p = flight.progress
    return PreemptRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, replica_id=flight.choice.replica_id,
        preempted_for=flight.preempted_for or "",
    )



def complete_command(p: Progress) -> CompleteRequest:
    return CompleteRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, finish_reason=p.finish_reason or "stop",
        ttft_ms=p.ttft_ms, tpot_us=p.tpot_us, tool_calls=p.tool_calls,
    )



def cancel_command(p: Progress, reason: CancelReason | None = None) -> CancelRequest:
    return CancelRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, reason=reason or "client_disconnected",
        engine_reported=p.engine_reported, tool_calls=p.tool_calls,
    )



def failure_text(exc: BaseException) -> str:
    """What a failed request's event says of a replica failure: its kind, status and codes,
    never the engine's message (an engine's validation error may quote the prompt, and prompts
    are never stored)."""
    if isinstance(exc, ReplicaHTTPError):
        err = exc.body.get("error") if isinstance(exc.body, dict) else None
        return f"replica answered {exc.status}" + (
            f" ({engine_error_text(err)})" if isinstance(err, dict) else ""
        )
    if isinstance(exc, ReplicaStreamBroken):
        return f"stream broken before [DONE]: {exc.reason}"  # our own words
    return str(exc) if isinstance(exc, ReplicaUnavailable) else type(exc).__name__



def engine_error_text(error: dict[str, Any]) -> str:
    fields = (f"{k}={error.get(k)}" for k in ("type", "code", "param") if error.get(k))
    return "engine error " + (" ".join(fields) or "(no code)")



def fail_command(p: Progress, error: str) -> FailRequest:
    return FailRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, error=error[:500], tool_calls=p.tool_calls,
    )



async def committed(admission: asyncio.Future[AppendResult] | None) -> bool:
    """Whether an admission whose waiter was cancelled committed after all (its commit goes on:
    it may already be in the store). Cancelled again meanwhile: unknown, and lease expiry ends
    the request if it did commit."""
    if admission is None:
        return False
    try:
        return (await admission).ok
    except BaseException:  # noqa: BLE001 - a failed or interrupted commit: not known committed
        return False



async def durable(ended: asyncio.Future[bool] | None) -> bool:
    """Whether a terminal event committed (None: the request was not ended by this edge's
    `end`, so there is nothing of ours to wait for). Shielded: a client leaving meanwhile must
    not cancel the recording."""
    if ended is None:
        return True
    return ended.result() if ended.done() else await asyncio.shield(ended)



async def abort_engine(exchange: ChatExchange | None, progress: Progress) -> None:
    """Stop the engine's generation (no-op once it ended) and count what it sent: the abort is
    how vLLM is told to stop, and it must never mask the error that brought us here."""
    if exchange is None:
        return
    try:
        await exchange.abort()
    except BaseException as exc:  # noqa: BLE001
        log.debug("aborting the engine request raised %r", exc)
    if exchange.last_usage is not None:
        progress.absorb_usage(exchange.last_usage)

