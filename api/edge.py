"""The customer path, as an application service over ports: parse, resolve the model, admit
(quota, then capacity), record the admission, relay the generation, and end every admitted
request with exactly one terminal event and its refund.

The rules it applies are `domain`'s (admission, capacity, lifecycle, backoff); the facts go
through the `Recorder`; the engine, the fleet, the token count, the clock and the ids are ports
(`api/ports.py`), so the whole path runs in a unit test with fakes. Nothing here waits on
anything remote before the admission decision: the quota view is local and the fleet view is the
last scrape.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from api import http
from api.admission import Admission, Refused
from api.auth import Authenticator, Caller
from api.chat_request import ChatRequest, parse_chat_request
from api.errors import ApiError, error_frame
from api.idempotency_service import replay_frames
from api.metrics import Metrics
from api.ports import EventSink, Fleet, Idempotency, OutputPredictor, TokenEstimator
from api.recorder import Flight, Recorder
from domain import goodput, lifecycle
from domain.admission import DEFAULT_POLICY, AdmissionPolicy
from domain.backoff import engine_priority
from domain.budgets import PathView
from domain.control import ControlView
from domain.events import PreemptionRequested, Recorded, RefusalsCounted
from domain.leases import LEASE_KEEPALIVE_S
from domain.quota import QuotaView
from domain.refusals import RefusalSampler
from domain.remote_flex import RemoteFlex
from domain.types import CancelReason
from domain.views import AdmissionViews
from engine_adapter.exchange import MAX_BUFFERED_CHUNKS, ChatExchange
from engine_adapter.usage import DONE, Collector, Progress, relay_stream
from engine_adapter.vllm_http import ReplicaHTTPError, ReplicaStreamBroken, ReplicaUnavailable
from ledger.commands import CommandHandler
from ledger.ids import Clock, IdSource, new_event_id, utcnow
from ledger.store import AppendResult

__all__ = ["Caller", "Edge", "JsonOutcome", "StreamOutcome"]

log = logging.getLogger("tollgate.edge")

_REPLICA_ERRORS = (ReplicaHTTPError, ReplicaUnavailable, ReplicaStreamBroken)


@dataclass(slots=True)
class JsonOutcome:
    status: int
    body: bytes
    headers: dict[str, str]


@dataclass(slots=True)
class StreamOutcome:
    headers: dict[str, str]
    frames: AsyncIterator[bytes]
    first: bytes = b""  # sent before `frames`
    # Whether the edge dropped the client (a slow reader that did not read its error either):
    # the task writing to it is cancelled then, and that is not an error.
    dropped: Callable[[], bool] = lambda: False


class Edge:
    def __init__(
        self,
        *,
        control: ControlView,
        quota: QuotaView,
        fleet: Fleet,
        events: EventSink,
        idempotency: Idempotency,
        metrics: Metrics,
        tokens: Callable[[str], TokenEstimator],
        edge_id: str,
        tpot_target_us: int = 40_000,
        rng: random.Random | None = None,
        clock: Clock = utcnow,
        new_id: IdSource = new_event_id,
        commands: CommandHandler | None = None,
        policy: AdmissionPolicy = DEFAULT_POLICY,
        predictor: OutputPredictor | None = None,
        slow_reader_s: float = 10.0,
        stream_buffer_chunks: int = MAX_BUFFERED_CHUNKS,
        paths: PathView | None = None,
        refusals: RefusalSampler | None = None,
    ) -> None:
        self.control = control
        self.fleet = fleet
        self.idempotency = idempotency
        self.metrics = metrics
        self.edge_id = edge_id
        self.rng = rng or random.Random()
        self.clock = clock
        self.policy = policy
        self.slow_reader_s = slow_reader_s  # 0: slow readers are never cancelled
        self.stream_buffer_chunks = stream_buffer_chunks
        # The quota, every level below the organization and the runs (domain.budgets), and the
        # flex work other edges serve: one facade, kept in step by `domain.views`. The path
        # view's buckets of levels it has not decided on yet are sized from the hierarchy when
        # another edge's admission there is folded (`observe`).
        self.views = AdmissionViews(
            quota,
            paths or PathView(
                backoff=policy.backoff,
                rates_for=lambda *level: self.control.hierarchy.level_rates(*level),
            ),
            RemoteFlex(edge_id),
        )  # fmt: skip
        # Which refusals are recorded one by one; the rest are counted per key and window.
        self.refusals = refusals or RefusalSampler()
        self.auth = Authenticator(control)
        self.recorder = Recorder(events, metrics, clock=clock, new_id=new_id, commands=commands)
        self.admission = Admission(
            control=control, views=self.views, fleet=fleet, metrics=metrics, tokens=tokens,
            recorder=self.recorder, reject=self._reject, preempt=self.preempt, edge_id=edge_id,
            rng=self.rng, clock=clock, policy=policy, predictor=predictor,
            tpot_target_us=tpot_target_us,
        )
        self.in_flight: dict[str, Flight] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Slow readers cancelled at the engine, whose client is dropped if it still reads
        # nothing by the deadline (monotonic).
        self._stalled: dict[str, tuple[Flight, float]] = {}
        self._keepalive_at: datetime | None = None  # the last renewal of every lease

    @property
    def quota(self) -> QuotaView:
        return self.views.quota

    @property
    def paths(self) -> PathView:
        return self.views.paths

    @property
    def others_flex(self) -> RemoteFlex:
        return self.views.others_flex

    @property
    def predictor(self) -> OutputPredictor | None:
        return self.admission.predictor

    @predictor.setter
    def predictor(self, predictor: OutputPredictor | None) -> None:
        self.admission.predictor = predictor

    def observed_types(self) -> frozenset[str]:
        """What `observe` folds: a follower of the log need read no other event type."""
        return self.views.folded_types()

    def observe(self, records: Sequence[Recorded]) -> None:
        """Fold events read back from the log (other edges' admissions, refunds, ends, bills)
        into this edge's quota and budget views. This edge's own events come back too: the
        views have already counted them and skip them. A PreemptionRequested of a flex request
        this edge serves preempts it here and now, as a preemption of its own router does."""
        for record in records:
            self.views.apply(record)
            if type(record.event) is PreemptionRequested:
                self._preemption_requested(record)

    def authenticate(self, authorization: str | None, scopes: frozenset[str]) -> Caller:
        return self.auth.authenticate(authorization, scopes)

    # --- the models on sale --------------------------------------------------------------------

    def models(self) -> list[str]:
        return self.admission.models()

    def resolve_model(self, requested: str) -> str | None:
        return self.admission.resolve_model(requested)

    # --- completions ---------------------------------------------------------------------------

    async def chat(
        self,
        caller: Caller,
        raw: bytes,
        *,
        request_id: str,
        idempotency_key: str | None,
        retry_count: int,
        run_id: str | None = None,
        batch_item: str = "",
    ) -> JsonOutcome | StreamOutcome:
        """One chat completion. `batch_item` ("<batch id>/<custom_id>"): the batch runner sends
        it, and it runs in the flex class whatever the body asks."""
        headers = {"X-Request-Id": request_id}
        try:
            req = parse_chat_request(raw)
        except ApiError as exc:
            self._reject(request_id, caller, "", "invalid", 0, exc.message, retry_count > 0)
            raise
        if batch_item:
            req.service_tier, req.batch_item = "flex", batch_item
        model = self.resolve_model(req.model)
        if model is None:
            self._reject(request_id, caller, req.model, "invalid", 0, "unknown model", False)
            raise ApiError(
                404, f"The model `{req.model}` does not exist or you do not have access to it.",
                param="model", code="model_not_found",
            )
        if idempotency_key is not None:
            req.body_sha256 = hashlib.sha256(raw).hexdigest()
            stored = await self.idempotency.lookup(
                caller.tenant_id, idempotency_key, req.body_sha256
            )
            if stored is not None:
                replay_headers = {**stored.headers, "Idempotent-Replayed": "true"}
                if stored.content_type == "text/event-stream":
                    return StreamOutcome(replay_headers, replay_frames(stored.body))
                return JsonOutcome(stored.status, stored.body, replay_headers)
        is_retry = retry_count > 0 or self.idempotency.seen_recently(
            caller.tenant_id, idempotency_key
        )
        answer = self.admission.admit(
            caller, req, model, request_id, idempotency_key, is_retry, headers, run_id
        )
        if isinstance(answer, Refused):
            raise answer.error
        flight = answer.flight
        await self._record_admission(flight, caller, req, answer.commands)
        body = dict(req.upstream)
        body["priority"] = engine_priority(caller.tier, req.service_tier)
        body["max_tokens"] = flight.state.output_cap_tokens
        if req.stream:
            return await self._open_stream(flight, caller, req, body, headers)
        return await self._complete(flight, caller, body, headers)

    async def _record_admission(
        self, flight: Flight, caller: Caller, req: ChatRequest,
        commands: tuple[lifecycle.Command, ...],
    ) -> None:
        """Make the admission durable before the engine sees the request: a generation without
        a recorded admission could never be billed. If it is not recorded, nothing was admitted:
        the quota and the router's reservation are given back, and there is no terminal event."""
        key = flight.idempotency_key
        began = False
        committing: asyncio.Future[AppendResult] | None = None
        try:
            if key is not None:  # 409 here, before anything is admitted
                await self.idempotency.begin(
                    caller.tenant_id, key, flight.request_id, req.body_sha256
                )
                began = True
            committing = self.recorder.commit(flight, *commands)
            if not self.recorder.count(await asyncio.shield(committing)):
                raise ApiError(
                    503, "the event store could not record the admission; retry later",
                    type="server_error", code="store_unavailable",
                )
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and await _committed(committing):
                # The client left while its admission was being committed, and it committed:
                # the request is admitted, so it ends here, cancelled (not by lease expiry 15 s
                # later, with its quota held meanwhile).
                self._track(flight)
                self._end(flight, _cancelled(flight.progress))
            else:
                self.admission.void(flight)
            if began:  # the key is ours: free it (never another request's in-flight key)
                await self.idempotency.abandon(caller.tenant_id, key or "")
            raise
        self._track(flight)

    async def _complete(
        self, flight: Flight, caller: Caller, body: dict[str, Any], headers: dict[str, str]
    ) -> JsonOutcome:
        key = flight.idempotency_key
        exchange: ChatExchange | None = None
        try:
            exchange = await self._open(flight, caller, body)
            collector = Collector(flight.progress, lambda: self._first_token(flight))
            await exchange.run(collector.feed)
            completion = collector.completion()
        except BaseException as exc:
            await self._fail(flight, caller, exchange, exc)
            if flight.preempted_for is not None and isinstance(exc, _PREEMPTED_ERRORS):
                raise self._preempted_error(headers) from None
            if isinstance(exc, _REPLICA_ERRORS):
                raise self._replica_error(exc, headers) from None
            raise
        error = flight.progress.error
        if error is not None:
            self._end(flight, _failed(flight.progress, _engine_error(error)))
            if key is not None:
                await self.idempotency.abandon(caller.tenant_id, key)
            raise ApiError(
                502, "the model replica failed while generating", type="server_error",
                code="replica_failed", headers=headers,
            )
        ended = self._end(flight, _completed(flight.progress))
        completion["service_tier"] = flight.service_tier
        answer = self._answer(flight, caller, ended, completion, headers)
        if flight.idempotency_key is None:
            return await answer
        # Shielded: the request is completed and billed, so its replay must be kept even if the
        # client leaves now (a record left in flight would answer every retry 409 for 24 h; the
        # batch runner, killed at this instant, met exactly that).
        return await asyncio.shield(answer)

    async def _answer(
        self, flight: Flight, caller: Caller, ended: asyncio.Future[bool] | None,
        completion: dict[str, Any], headers: dict[str, str],
    ) -> JsonOutcome:  # fmt: skip
        """A non-streamed answer, once its terminal event has committed: a client never holds
        an answer the ledger does not know (if it cannot commit, the lease expiry bills what was
        renewed, and the client gets a 503 instead)."""
        key = flight.idempotency_key
        if not await _durable(ended):
            if key is not None:
                await self.idempotency.abandon(caller.tenant_id, key)
            raise ApiError(
                503, _NOT_RECORDED, type="server_error", code="not_recorded", headers=headers
            )
        payload = orjson.dumps(completion)
        if key is not None:
            await self.idempotency.complete(
                caller.tenant_id, key, 200, payload, "application/json", headers
            )
        return JsonOutcome(200, payload, headers)

    async def _open_stream(
        self, flight: Flight, caller: Caller, req: ChatRequest, body: dict[str, Any],
        headers: dict[str, str],
    ) -> StreamOutcome:
        exchange: ChatExchange | None = None
        try:
            exchange = await self._open(flight, caller, body)
            # Wait for the first chunk (it comes with the first token) so that anything that
            # fails before it still gets a real HTTP status.
            await exchange.prime()
        except BaseException as exc:
            await self._fail(flight, caller, exchange, exc)
            if flight.preempted_for is not None and isinstance(exc, _PREEMPTED_ERRORS):
                raise self._preempted_error(headers) from None
            if isinstance(exc, _REPLICA_ERRORS):
                raise self._replica_error(exc, headers) from None
            raise
        exchange.max_buffered = self.stream_buffer_chunks
        flight.owner = asyncio.current_task()
        frames = self._stream(flight, req, exchange, caller)
        # Its first frame is taken here: from then on, closing the generator (a client that
        # leaves before reading anything) runs its cancellation path.
        return StreamOutcome(headers, frames, await anext(frames), lambda: flight.dropped)

    async def _open(self, flight: Flight, caller: Caller, body: dict[str, Any]) -> ChatExchange:
        """Open the engine request, where a preemption can reach it. A flex request preempted
        while it was being opened is aborted at once (it raises `Preempted`)."""
        exchange = await flight.choice.replica.open_chat(
            body, request_id=flight.request_id, cache_salt=caller.cache_salt
        )
        flight.exchange = exchange
        if flight.preempted_for is not None:
            await _abort(exchange, flight.progress)
            raise Preempted(flight.preempted_for)
        return exchange

    def _preempted_error(self, headers: dict[str, str]) -> ApiError:
        return http.preempted(self.policy.backoff.retry_after_s(self.rng.random()), headers)

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
                self._background(self._preempt(flight, exchange))

    def _preemption_requested(self, record: Recorded) -> None:
        event = record.event
        assert isinstance(event, PreemptionRequested)
        flight = self.in_flight.get(event.request_id)
        if flight is None or event.requested_by == self.edge_id:
            return  # not served here (or over): its own edge, or nobody, answers it
        self.recorder.observed(flight, record)
        self.preempt((event.request_id,), event.preempted_for)

    async def _preempt(self, flight: Flight, exchange: ChatExchange) -> None:
        await _abort(exchange, flight.progress)  # the engine's count of what it had done
        self._end(flight, _preempted(flight))

    async def _fail(
        self, flight: Flight, caller: Caller, exchange: ChatExchange | None, exc: BaseException
    ) -> None:
        """End a request whose generation broke before it could answer: abort first (it reads
        what the engine already sent, which is billed), then the terminal event, then free its
        Idempotency-Key (nothing to replay: the client's retry must be able to run)."""
        await _abort(exchange, flight.progress)
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cancelled:
            self._end(flight, _cancelled(flight.progress))
        elif isinstance(exc, _REPLICA_ERRORS):
            self._end(flight, _failed(flight.progress, _failure(exc)))
        elif isinstance(exc, Preempted):
            self._end(flight, _preempted(flight))
        else:
            self._end(flight, _failed(flight.progress, f"edge error: {type(exc).__name__}"))
        key = flight.idempotency_key
        if key is not None:
            abandon = self.idempotency.abandon(caller.tenant_id, key)
            if cancelled:  # this task is being cancelled: an await here could be cut short
                self._background(abandon)
            else:
                await abandon

    async def _stream(
        self, flight: Flight, req: ChatRequest, exchange: ChatExchange, caller: Caller
    ) -> AsyncIterator[bytes]:
        transcript: list[bytes] | None = [] if flight.idempotency_key else None
        held: list[bytes] = []  # the answer's end, sent once its terminal event committed
        # The engine is read in the exchange's own callbacks, not in this generator's task: a
        # client disconnect that cancels this task can never drop what the engine already sent.
        client_gone = False
        try:
            async for frame in relay_stream(
                exchange, flight.progress, include_usage=req.include_usage,
                continuous_usage=req.continuous_usage,
                on_first_token=lambda: self._first_token(flight, stream=True),
                service_tier=flight.service_tier,
            ):
                if transcript is not None:
                    transcript.append(frame)
                first, flight.first_durable = flight.first_durable, None
                if first is not None:
                    # The engine's prompt count is durable before the client sees a token:
                    # one group commit on the time to first token. (Not recorded: the
                    # terminal event carries the counts anyway.)
                    await _durable(first)
                if held or flight.progress.finish_reason is not None:
                    # The answer's last chunk and what follows (the final usage) wait for the
                    # terminal event's commit: a client never holds a complete answer the
                    # ledger does not know.
                    held.append(frame)
                    continue
                yield frame
                if flight.cancel_reason is not None:
                    self._reading(flight)
            error = flight.progress.error
            if error is not None:
                ended = self._end(flight, _failed(flight.progress, _engine_error(error)))
            else:
                ended = self._end(flight, _completed(flight.progress))
            if not await _durable(ended):
                if flight.idempotency_key:
                    await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)
                yield error_frame(_NOT_RECORDED, code="not_recorded")
                yield DONE
                return
            for frame in held:
                yield frame
            if error is None and transcript is not None:
                transcript.append(DONE)
                await self.idempotency.complete(
                    caller.tenant_id, flight.idempotency_key or "", 200,
                    b"".join(transcript), "text/event-stream",
                    {"X-Request-Id": flight.request_id},
                )
            yield DONE
        except _PREEMPTED_ERRORS as exc:
            if flight.preempted_for is None and not isinstance(exc, _REPLICA_ERRORS):
                client_gone = True  # an in-process engine's task cancelled: as below
                self._background(self._cancel_stream(flight, exchange, caller))
                raise
            # After the first token the status is sent: the failure is an error object in the
            # stream, then [DONE], never a silently truncated answer.
            await _abort(exchange, flight.progress)  # counts what the engine reported
            # Each error object, then [DONE], once the terminal event is durable (or known not
            # to be: then the lease expiry bills what was renewed).
            if flight.preempted_for is not None:
                await _durable(self._end(flight, _preempted(flight)))
                yield error_frame(
                    http.PREEMPTED_MESSAGE, type="resource_unavailable", code="preempted"
                )
            elif flight.cancel_reason == "slow_reader":  # the edge stopped it: say so
                await _durable(self._end(flight, _cancelled(flight.progress, "slow_reader")))
                yield error_frame(
                    f"the stream was cancelled: the client read nothing for "
                    f"{self.slow_reader_s:g} s while its buffer was full; billed the "
                    f"{flight.progress.completion_tokens} completion tokens the engine produced",
                    code="slow_reader",
                )
                self._reading(flight)
            else:
                await _durable(self._end(flight, _failed(flight.progress, _failure(exc))))
                yield error_frame("the model replica failed mid-stream", code="replica_failed")
            yield DONE
        except BaseException:
            # Client gone (CancelledError from Starlette, or GeneratorExit): cancel at once. The
            # abort, the count and the terminal event run in their own task: awaits here would
            # be cancelled again before they ran.
            client_gone = True
            self._background(self._cancel_stream(flight, exchange, caller))
            raise
        finally:
            self._stalled.pop(flight.request_id, None)
            if not client_gone:
                await _abort(exchange, flight.progress)
                if flight.idempotency_key and flight.state.status != "completed":
                    await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)

    async def _cancel_stream(
        self, flight: Flight, exchange: ChatExchange, caller: Caller
    ) -> None:
        """Abort the engine request and bill what it sent: everything received before the
        upstream connection is closed (vLLM's abort signal) and what the abort drains."""
        await _abort(exchange, flight.progress)  # never raises
        self._end(flight, _cancelled(flight.progress, flight.cancel_reason))
        if flight.idempotency_key:
            await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)

    # --- slow readers --------------------------------------------------------------------------

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
            self._background(self._cancel_slow_reader(flight, exchange))
        for request_id, (flight, deadline) in list(self._stalled.items()):
            if now < deadline:
                continue
            del self._stalled[request_id]
            owner = flight.owner
            if owner is not None and not owner.done():
                flight.dropped = True
                self.metrics.slow_readers_dropped.inc()
                owner.cancel()

    def _reading(self, flight: Flight) -> None:
        """A cancelled slow reader took a frame: it is not dropped before another timeout."""
        if flight.request_id in self._stalled:
            self._stalled[flight.request_id] = (flight, time.monotonic() + self.slow_reader_s)

    async def _cancel_slow_reader(self, flight: Flight, exchange: ChatExchange) -> None:
        await _abort(exchange, flight.progress)  # never raises; drains the engine's count
        self._end(flight, _cancelled(flight.progress, "slow_reader"))

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replica_error(self, exc: BaseException, headers: dict[str, str]) -> ApiError:
        if isinstance(exc, ReplicaHTTPError) and 400 <= exc.status < 500 and exc.status != 429:
            err = exc.body.get("error", {}) if isinstance(exc.body, dict) else {}
            err = err if isinstance(err, dict) else {}
            return ApiError(
                exc.status, str(err.get("message") or exc), param=err.get("param"),
                code="engine_rejected", headers=headers,
            )
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        return http.replica_unavailable(retry_after, headers)

    # --- lifecycle bookkeeping -----------------------------------------------------------------

    def _first_token(self, flight: Flight, stream: bool = False) -> None:
        """The first chunk arrived: record its instant and the engine's prompt counts (its
        continuous usage stats), which a lease expiry bills at least from then on.

        A stream's goes to the next group commit (within 5 ms, with other requests' ends and
        first tokens; committing it and the end in this loop iteration's group instead cost more
        CPU per request in the gateway bench), and its first frame waits for it (`_stream`): a
        client that saw a token is billed at least its prompt whatever happens to this edge
        next. A non-streamed request's is staged: it goes with the next lease renewal (0.1 s)
        or its terminal event, saving a commit per request."""
        p = flight.progress
        exchange = flight.exchange
        if exchange is not None and exchange.last_usage is not None:
            p.absorb_usage(exchange.last_usage)
        ttft_ms = p.ttft_ms
        self.metrics.ttft_of(flight.model).observe(ttft_ms / 1000)
        command = lifecycle.RecordFirstToken(
            ttft_ms=ttft_ms, prompt_tokens=p.prompt_tokens,
            cached_tokens=min(p.cached_tokens, p.prompt_tokens),
        )  # fmt: skip
        if stream:
            flight.first_durable = self.recorder.record(flight, command)
        else:
            self.recorder.stage(flight, command)

    def _track(self, flight: Flight) -> None:
        """An admitted request is in flight on this edge until `_end`."""
        self.in_flight[flight.request_id] = flight
        self.metrics.in_flight.inc()
        self.metrics.admitted_of(flight.tier, flight.model).inc()

    def _end(self, flight: Flight, command: _Terminal) -> asyncio.Future[bool] | None:
        """The one place a request ends on this edge: terminal event, refund, release. Returns
        whether the terminal event became durable, as a future (`_durable`), for what must not
        reach the client before it: the final usage, [DONE], a JSON body."""
        if flight.finished:
            return flight.ended
        if flight.preempted_for is not None and not isinstance(command, lifecycle.PreemptRequest):
            # Whatever path noticed the abort first (the stream breaking, the preemption's own
            # task), a preempted request ends preempted, with the engine's counts.
            command = _preempted(flight)
        flight.finished = True
        p = flight.progress
        if isinstance(command, lifecycle.CompleteRequest) and p.tpot_us:
            self.metrics.tpot_of(flight.model).observe(p.tpot_us / 1e6)
        try:
            flight.ended = self.recorder.record(flight, command)
        finally:
            self.admission.settle(flight, command)
            if self.in_flight.pop(flight.request_id, None) is not None:
                self.metrics.in_flight.dec()
            status = _TERMINAL_LABEL[type(command)]
            self.metrics.finished_of(status).inc()
            admitted_at = flight.state.admitted_at or self.clock()
            self._count_outcome(
                flight.tenant_id, flight.tier, flight.model, status, admitted_at, command
            )
        return flight.ended

    def _count_outcome(
        self, tenant_id: str, tier: str, model: str, status: str, admitted_at: datetime,
        command: _Terminal | None = None, reject_reason: str | None = None,
    ) -> None:
        """The live goodput counters: the same classification as `tollgate ledger goodput`,
        against the objective in force at the request's admission."""
        done = command if isinstance(command, lifecycle.CompleteRequest) else None
        found = goodput.outcome(
            status,
            self.control.slo(tier, admitted_at),
            ttft_ms=done.ttft_ms if done else None,
            tpot_us=done.tpot_us if done else None,
            reject_reason=reject_reason,
        )
        if found is not None:
            self.metrics.count_outcome(tenant_id, tier, model, found)

    def _reject(
        self, request_id: str, caller: Caller, model: str, reason: str, retry_after_s: int,
        detail: str, is_retry: bool,
    ) -> None:
        self.metrics.rejected.labels(reason, caller.tier).inc()
        now = self.clock()
        self._count_outcome(
            caller.tenant_id, caller.tier, model, "rejected", now, reject_reason=reason
        )
        # An invalid request's model may be any name the client made up: counted as "".
        counted_model = "" if reason == "invalid" else model
        # As many in full per minute as the plan admits requests (domain.refusals).
        rpm = self.control.limits(caller.tenant_id, "*").rpm
        if not self.refusals.record_in_full(
            caller.key_id, caller.tenant_id, counted_model, caller.tier, reason, now, rpm
        ):
            return  # counted, recorded with the others of its window once that has closed
        self.recorder.reject(
            lifecycle.RejectRequest(
                request_id=request_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
                model=model, tier=caller.tier, reason=reason,  # type: ignore[arg-type]
                retry_after_s=retry_after_s, detail=detail[:300], is_retry=is_retry,
            ),
            caller.tenant_id,
            now,
        )

    def record_counted_refusals(self, *, everything: bool = False) -> int:
        """One `RefusalsCounted` per key, window, model, tier and reason whose window has closed
        (`everything`: the open ones too, at shutdown); returns how many were recorded."""
        now = self.clock()
        counted = self.refusals.drain() if everything else self.refusals.closed(now)
        for c in counted:
            event = RefusalsCounted(
                c.tenant_id, c.key_id, c.model, c.tier, c.reason, c.window_start, c.window_s,
                c.count,
            )
            stream_id = "rfs_" + self.recorder.new_id().replace("-", "")
            self.recorder.fact(stream_id, c.tenant_id, event, 0, now)
        return len(counted)

    # --- leases --------------------------------------------------------------------------------

    def renew_leases(self) -> None:
        """Called every `LEASE_RENEW_S` (0.1 s): one LeasesRenewed for this edge carrying the
        engine counts of the in-flight requests that progressed since the last one (none did:
        nothing is written), and every `LEASE_KEEPALIVE_S` (0.5 s) of all of them, which also
        has the quota view forget what has aged out of its windows."""
        now = self.clock()
        keepalive = self._keepalive_at is None or (
            (now - self._keepalive_at).total_seconds() >= LEASE_KEEPALIVE_S
        )
        if keepalive:
            self._keepalive_at = now
            self.views.prune(now)
            self.record_counted_refusals()
        self.recorder.renew(self.edge_id, list(self.in_flight.values()), everyone=keepalive)


_Terminal = (
    lifecycle.CompleteRequest
    | lifecycle.CancelRequest
    | lifecycle.FailRequest
    | lifecycle.PreemptRequest
)
_TERMINAL_LABEL: dict[type, str] = {
    lifecycle.CompleteRequest: "completed",
    lifecycle.CancelRequest: "cancelled",
    lifecycle.FailRequest: "failed",
    lifecycle.PreemptRequest: "preempted",
}


# What a client gets instead of an answer whose terminal event could not be recorded (the event
# store stayed away, or the request had been ended meanwhile, by its lease expiry): the ledger's
# bill is then what the edge had renewed, never what this answer would have said.
_NOT_RECORDED = "the answer could not be recorded, so it is not sent; retry later"


class Preempted(Exception):
    """A flex request was preempted before its engine request was opened."""


# What a flex request's path sees when its preemption aborts the engine request (an in-process
# engine's exchange ends with ConnectionAbortedError).
_PREEMPTED_ERRORS = (*_REPLICA_ERRORS, Preempted, ConnectionAbortedError)


def _preempted(flight: Flight) -> lifecycle.PreemptRequest:
    p = flight.progress
    return lifecycle.PreemptRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, replica_id=flight.choice.replica_id,
        preempted_for=flight.preempted_for or "",
    )


def _completed(p: Progress) -> lifecycle.CompleteRequest:
    return lifecycle.CompleteRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, finish_reason=p.finish_reason or "stop",
        ttft_ms=p.ttft_ms, tpot_us=p.tpot_us, tool_calls=p.tool_calls,
    )


def _cancelled(p: Progress, reason: CancelReason | None = None) -> lifecycle.CancelRequest:
    return lifecycle.CancelRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, reason=reason or "client_disconnected",
        engine_reported=p.engine_reported, tool_calls=p.tool_calls,
    )


def _failure(exc: BaseException) -> str:
    """What a failed request's event says of a replica failure: its kind, status and codes,
    never the engine's message (an engine's validation error may quote the prompt, and prompts
    are never stored)."""
    if isinstance(exc, ReplicaHTTPError):
        err = exc.body.get("error") if isinstance(exc.body, dict) else None
        return f"replica answered {exc.status}" + (
            f" ({_engine_error(err)})" if isinstance(err, dict) else ""
        )
    if isinstance(exc, ReplicaStreamBroken):
        return f"stream broken before [DONE]: {exc.reason}"  # our own words
    return str(exc) if isinstance(exc, ReplicaUnavailable) else type(exc).__name__


def _engine_error(error: dict[str, Any]) -> str:
    fields = (f"{k}={error.get(k)}" for k in ("type", "code", "param") if error.get(k))
    return "engine error " + (" ".join(fields) or "(no code)")


def _failed(p: Progress, error: str) -> lifecycle.FailRequest:
    return lifecycle.FailRequest(
        prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        cached_tokens=p.cached_tokens, error=error[:500], tool_calls=p.tool_calls,
    )


async def _committed(admission: asyncio.Future[AppendResult] | None) -> bool:
    """Whether an admission whose waiter was cancelled committed after all (its commit goes on:
    it may already be in the store). Cancelled again meanwhile: unknown, and lease expiry ends
    the request if it did commit."""
    if admission is None:
        return False
    try:
        return (await admission).ok
    except BaseException:  # noqa: BLE001 - a failed or interrupted commit: not known committed
        return False


async def _durable(ended: asyncio.Future[bool] | None) -> bool:
    """Whether a terminal event committed (None: the request was not ended by this edge's
    `_end`, so there is nothing of ours to wait for). Shielded: a client leaving meanwhile must
    not cancel the recording."""
    if ended is None:
        return True
    return ended.result() if ended.done() else await asyncio.shield(ended)


async def _abort(exchange: ChatExchange | None, progress: Progress) -> None:
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
