"""The customer path: authenticate, admit (quota, then capacity), route, relay, and end every
admitted request with exactly one terminal event and its refund.

This is the application service the routes call; the rules it applies live in `domain`
(lifecycle, admission, capacity), the facts it records go through the group-commit writer, and the
engine is reached through `engine_adapter`. Nothing here waits on anything remote before the
admission decision: the quota view is local and the fleet view is the last scrape.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from api.chat_request import ChatRequest, parse_chat_request
from api.commits import LoopCommits
from api.errors import ApiError, error_frame
from api.idempotency_service import AsyncIdempotency, replay_frames
from api.metrics import Metrics
from api.relay import DONE, Collector, Progress, relay_stream
from domain import admission, lifecycle
from domain.control import ControlView
from domain.cost import base_model, profile_for, tpot_estimate_us
from domain.events import LeaseProgress, LeasesRenewed, RequestRejected
from engine_adapter.exchange import ChatExchange
from engine_adapter.fleet import Choice, Fleet, UnknownModel
from engine_adapter.simulated import count_prompt_tokens
from engine_adapter.vllm_http import (
    ReplicaHTTPError,
    ReplicaStreamBroken,
    ReplicaUnavailable,
)
from ledger.store import AppendBatch, AppendResult, NewEvent
from ledger.writer import GroupCommitWriter

log = logging.getLogger("tollgate.edge")

# vLLM's `priority`: lower is served first; the edge sets it from the tier, never the client.
TIER_PRIORITY = {"enterprise": 0, "standard": 1, "free": 2}


@dataclass(frozen=True, slots=True)
class Caller:
    key_id: str
    tenant_id: str
    scope: str
    tier: str
    cache_salt: str


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


@dataclass(slots=True)
class InFlight:
    """One admitted request on this edge: what the lease renewal reports and the end refunds."""

    request_id: str
    tenant_id: str
    model: str
    state: lifecycle.RequestState
    progress: Progress
    choice: Any
    finished: bool = False
    idempotency_key: str | None = None
    # Decided but not yet submitted (the first-token event rides with the next append).
    pending: list[NewEvent] = field(default_factory=list)
    pending_from: int = 0  # the stream version the pending events follow


# Event and request ids need uniqueness, not secrecy: a PRNG seeded from the OS avoids a system
# call per id (uuid4 was ~4 % of the edge's CPU). They are UUID version 7 (RFC 9562): 48 bits of
# Unix milliseconds, then 74 random bits, so ids made later sort later. The events table's
# unique indexes (event_id; stream_id, stream_version) and the read models keyed by request id
# then grow at their right edge: with random ids every commit touched a random leaf page of each
# index, and on a database of a million events commits slowed enough to matter (measured with
# bench/gateway.py after 60k requests).
_ids = random.Random(int.from_bytes(os.urandom(16), "big"))
_V7_VERSION = 0x7 << 76
_V7_VARIANT = 0x2 << 62


def _v7_hex() -> str:
    ms = time.time_ns() // 1_000_000
    rand = _ids.getrandbits(74)
    value = (ms << 80) | _V7_VERSION | ((rand >> 62) << 64) | _V7_VARIANT | (rand & ((1 << 62) - 1))
    return f"{value:032x}"


def new_id() -> str:
    h = _v7_hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_request_id() -> str:
    return "req_" + _v7_hex()


def utcnow() -> datetime:
    return datetime.now(UTC)


class Edge:
    def __init__(
        self,
        *,
        control: ControlView,
        quota: admission.QuotaView,
        fleet: Fleet,
        writer: GroupCommitWriter,
        idempotency: AsyncIdempotency,
        metrics: Metrics,
        edge_id: str,
        tpot_target_us: int = 40_000,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.control = control
        self.quota = quota
        self.fleet = fleet
        self.commits = LoopCommits(writer)
        self.idempotency = idempotency
        self.metrics = metrics
        self.edge_id = edge_id
        self.tpot_target_us = tpot_target_us
        self.rng = rng or random.Random()
        self.clock = clock
        self.in_flight: dict[str, InFlight] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- auth --------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None, scopes: frozenset[str]) -> Caller:
        if not authorization or not authorization.startswith("Bearer "):
            raise ApiError(
                401, "missing bearer token in the Authorization header",
                type="authentication_error", code="invalid_api_key",
            )
        secret = authorization[7:].strip()
        # Keys are looked up by their SHA-256: the table is keyed by digest, so the comparison a
        # timing attack could probe is a dict lookup on a hash the attacker cannot steer.
        key = self.control.key_by_hash(hashlib.sha256(secret.encode()).hexdigest())
        if key is None or key.revoked:
            raise ApiError(
                401, "invalid or revoked API key", type="authentication_error",
                code="invalid_api_key",
            )
        if key.scope not in scopes:
            raise ApiError(
                403, f"a {key.scope} key may not call this endpoint",
                type="permission_error", code="insufficient_scope",
            )
        tenant = self.control.tenant(key.tenant_id)
        return Caller(key.key_id, key.tenant_id, key.scope, tenant.plan, tenant.cache_salt)

    # --- completions ---------------------------------------------------------------------------

    def models(self) -> list[str]:
        """Model versions on sale: served by the fleet and priced now. An unpriced model could
        never be billed, so it is not offered (and the billing fold never meets one)."""
        now = self.clock()
        return [m for m in self.fleet.models() if self.control.has_price(m, now)]

    def resolve_model(self, requested: str) -> str | None:
        """A pinned version is served as is (if on sale); a base name goes to its newest
        version on sale."""
        if requested in self.fleet.serves:  # a version: no need to list every model on sale
            return requested if self.control.has_price(requested, self.clock()) else None
        versions = [m for m in self.models() if base_model(m) == requested]
        return max(versions) if versions else None

    async def chat(
        self,
        caller: Caller,
        raw: bytes,
        *,
        request_id: str,
        idempotency_key: str | None,
        retry_count: int,
    ) -> JsonOutcome | StreamOutcome:
        headers = {"X-Request-Id": request_id}
        try:
            req = parse_chat_request(raw)
        except ApiError as exc:
            self._reject(request_id, caller, "", "invalid", 0, exc.message, retry_count > 0)
            raise
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

        now = self.clock()
        limits = self.control.limits(caller.tenant_id, model)
        profile = profile_for(model)
        measured = self.fleet.tpot_p95(model)
        tpot_us = tpot_estimate_us(
            measured.p95_us if measured else None,
            measured.age_s if measured else None,
            self.tpot_target_us,
        )
        decision = self.quota.decide(
            admission.ReserveQuota(
                request_id=request_id,
                tenant_id=caller.tenant_id,
                key_id=caller.key_id,
                model=model,
                tier=caller.tier,
                edge_id=self.edge_id,
                prompt_tokens=count_prompt_tokens(req.messages),
                max_tokens=req.max_tokens,
                kv_bytes_per_token=profile.kv_bytes_per_token,
                tpot_us=tpot_us,
                now=now,
                jitter=self.rng.random(),
                is_retry=is_retry,
            ),
            limits,
        )
        headers.update(decision.headers())
        if isinstance(decision, admission.Rejected):
            self._reject(
                request_id, caller, model, decision.reason, decision.retry_after_s,
                decision.detail, is_retry,
            )
            raise ApiError(
                decision.http_status, decision.detail, type=_error_type(decision.reason),
                param=decision.param, code=_error_code(decision.reason), headers=headers,
            )

        estimate = decision.estimate
        choice = self.fleet.choose(
            model, caller.tier, estimate.prompt_tokens + estimate.reserved_output_tokens, self.rng
        )
        if not isinstance(choice, Choice):
            self.quota.void(request_id)
            retry_after = 5 + self.rng.randrange(0, 6)
            detail = "no replica serves it" if isinstance(choice, UnknownModel) else choice.detail
            self._reject(request_id, caller, model, "capacity", retry_after, detail, is_retry)
            headers["Retry-After"] = str(retry_after)
            raise ApiError(
                503, f"no capacity for {model} at the {caller.tier} tier ({detail}); "
                "retry after the Retry-After delay",
                type="capacity", code="server_overloaded", headers=headers,
            )

        flight = InFlight(
            request_id, caller.tenant_id, model, lifecycle.RequestState(), Progress(), choice,
            idempotency_key=idempotency_key,
        )
        admit = lifecycle.AdmitRequest(
            request_id=request_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
            model=model, tier=caller.tier, edge_id=self.edge_id, estimate=estimate,
            idempotency_key=idempotency_key, is_retry=is_retry, stream=req.stream,
        )
        route = lifecycle.RouteRequest(
            request_id=request_id, replica_id=choice.replica_id,
            occupancy_ppm=choice.occupancy_ppm,
        )
        began = False
        committing: asyncio.Future[AppendResult] | None = None
        try:
            if idempotency_key is not None:  # 409 here, before anything is admitted
                await self.idempotency.begin(
                    caller.tenant_id, idempotency_key, request_id, req.body_sha256
                )
                began = True
            # The admission is durable before the engine sees the request: a generation without
            # a recorded admission could never be billed. If it is not recorded, nothing was
            # admitted: the quota and the router's reservation are given back, no terminal event.
            committing = self._submit_admission(flight, admit, route)
            self._check_admission(await asyncio.shield(committing))
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and await _committed(committing):
                # The client left while its admission was being committed, and it committed:
                # the request is admitted, so it ends here, cancelled (not by lease expiry 15 s
                # later, with its quota held meanwhile).
                self._track(flight, caller.tier)
                self._finish(flight, "cancelled")
            else:
                self.quota.void(request_id)
                self.fleet.release(choice)
            if began:  # the key is ours: free it (never another request's in-flight key)
                await self.idempotency.abandon(caller.tenant_id, idempotency_key or "")
            raise
        self._track(flight, caller.tier)

        body = dict(req.upstream)
        body["priority"] = TIER_PRIORITY.get(caller.tier, 2)
        body["max_tokens"] = estimate.reserved_output_tokens
        exchange: ChatExchange | None = None
        try:
            exchange = await choice.replica.open_chat(
                body, request_id=request_id, cache_salt=caller.cache_salt
            )
            if req.stream:
                # Wait for the first chunk (it comes with the first token) so that anything that
                # fails before it still gets a real HTTP status.
                await exchange.prime()
                frames = self._stream(flight, req, exchange, caller)
                # Its first frame is taken here: from then on, closing the generator (a client
                # that leaves before reading anything) runs its cancellation path.
                return StreamOutcome(headers, frames, await anext(frames))
            collector = Collector(flight.progress, lambda: self._first_token(flight))
            await exchange.run(collector.feed)
            completion = collector.completion()
        except asyncio.CancelledError:
            # Abort first: it reads what the engine already sent, which is billed.
            await _abort(exchange, flight.progress)
            self._finish(flight, "cancelled")
            raise
        except (ReplicaHTTPError, ReplicaUnavailable, ReplicaStreamBroken) as exc:
            await _abort(exchange, flight.progress)  # counts what the engine reported
            self._finish(flight, "failed", error=str(exc))
            if idempotency_key is not None:
                await self.idempotency.abandon(caller.tenant_id, idempotency_key)
            raise _replica_error(exc, headers, self.rng) from None
        except BaseException as exc:
            await _abort(exchange, flight.progress)
            self._finish(flight, "failed", error=f"edge error: {type(exc).__name__}")
            raise
        if flight.progress.error is not None:
            self._finish(flight, "failed", error=str(flight.progress.error.get("message")))
            if idempotency_key is not None:
                await self.idempotency.abandon(caller.tenant_id, idempotency_key)
            raise ApiError(
                502, "the model replica failed while generating", type="server_error",
                code="replica_failed", headers=headers,
            )
        self._finish(flight, "completed")
        payload = orjson.dumps(completion)
        if idempotency_key is not None:
            await self.idempotency.complete(
                caller.tenant_id, idempotency_key, 200, payload, "application/json", headers
            )
        return JsonOutcome(200, payload, headers)

    async def _stream(
        self, flight: InFlight, req: ChatRequest, exchange: ChatExchange, caller: Caller
    ) -> AsyncIterator[bytes]:
        transcript: list[bytes] | None = [] if flight.idempotency_key else None
        # The engine is read in the exchange's own callbacks, not in this generator's task: a
        # client disconnect that cancels this task can never drop what the engine already sent.
        client_gone = False
        try:
            async for frame in relay_stream(
                exchange, flight.progress, include_usage=req.include_usage,
                continuous_usage=req.continuous_usage,
                on_first_token=lambda: self._first_token(flight),
            ):
                if transcript is not None:
                    transcript.append(frame)
                yield frame
            if flight.progress.error is not None:
                self._finish(flight, "failed", error=str(flight.progress.error.get("message")))
            else:
                self._finish(flight, "completed")
                if transcript is not None:
                    transcript.append(DONE)
                    await self.idempotency.complete(
                        caller.tenant_id, flight.idempotency_key or "", 200,
                        b"".join(transcript), "text/event-stream",
                        {"X-Request-Id": flight.request_id},
                    )
            yield DONE
        except (ReplicaStreamBroken, ReplicaUnavailable, ReplicaHTTPError) as exc:
            # After the first token the status is sent: the failure is an error object in the
            # stream, then [DONE], never a silently truncated answer.
            await _abort(exchange, flight.progress)  # counts what the engine reported
            self._finish(flight, "failed", error=str(exc))
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
            if not client_gone:
                await _abort(exchange, flight.progress)
                if flight.idempotency_key and flight.state.status != "completed":
                    await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)

    async def _cancel_stream(
        self, flight: InFlight, exchange: ChatExchange, caller: Caller
    ) -> None:
        """Abort the engine request and bill what it sent: everything received before the
        upstream connection is closed (vLLM's abort signal) and what the abort drains."""
        await _abort(exchange, flight.progress)  # never raises
        self._finish(flight, "cancelled")
        if flight.idempotency_key:
            await self.idempotency.abandon(caller.tenant_id, flight.idempotency_key)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- lifecycle bookkeeping -----------------------------------------------------------------

    def _first_token(self, flight: InFlight) -> None:
        ttft_ms = flight.progress.ttft_ms
        self.metrics.ttft_of(flight.model).observe(ttft_ms / 1000)
        # Staged, not written: it goes with the terminal event or the next lease renewal (5 s),
        # which saves a commit per request without losing the instant it happened.
        self._stage(flight, (lifecycle.RecordFirstToken(request_id=flight.request_id,
                                                        ttft_ms=ttft_ms),))

    def _finish(self, flight: InFlight, how: str, *, error: str = "") -> None:
        """The one place a request ends on this edge: terminal event, refund, release."""
        if flight.finished:
            return
        flight.finished = True
        p = flight.progress
        rid = flight.request_id
        command: Any
        if how == "completed":
            command = lifecycle.CompleteRequest(
                request_id=rid, prompt_tokens=p.prompt_tokens,
                completion_tokens=p.completion_tokens, cached_tokens=p.cached_tokens,
                finish_reason=p.finish_reason or "stop", ttft_ms=p.ttft_ms, tpot_us=p.tpot_us,
            )
            if p.tpot_us:
                self.metrics.tpot_of(flight.model).observe(p.tpot_us / 1e6)
        elif how == "cancelled":
            command = lifecycle.CancelRequest(
                request_id=rid, prompt_tokens=p.prompt_tokens,
                completion_tokens=p.completion_tokens, cached_tokens=p.cached_tokens,
                reason="client_disconnected", engine_reported=p.engine_reported,
            )
        else:
            command = lifecycle.FailRequest(
                request_id=rid, prompt_tokens=p.prompt_tokens,
                completion_tokens=p.completion_tokens, cached_tokens=p.cached_tokens,
                error=error[:500],
            )
        try:
            self._record_nowait(flight, command)
        finally:
            self.quota.refund(rid, p.prompt_tokens + p.completion_tokens, self.clock())
            self.fleet.release(flight.choice)
            if self.in_flight.pop(rid, None) is not None:
                self.metrics.in_flight.dec()
            self.metrics.finished_of(how).inc()

    def _submit_admission(self, flight: InFlight, *commands: Any) -> asyncio.Future[AppendResult]:
        """Record the admission with this loop iteration's group; the future is its commit."""
        self._stage(flight, commands)
        return self.commits.commit(self._take_pending(flight))

    def _check_admission(self, result: AppendResult) -> None:
        self._count_append(result)
        if not result.ok:
            raise ApiError(
                503, "the event store could not record the admission; retry later",
                type="server_error", code="store_unavailable",
            )

    def _track(self, flight: InFlight, tier: str) -> None:
        """An admitted request is in flight on this edge until `_finish`."""
        self.in_flight[flight.request_id] = flight
        self.metrics.in_flight.inc()
        self.metrics.admitted_of(tier, flight.model).inc()

    def _record_nowait(self, flight: InFlight, *commands: Any) -> None:
        self._stage(flight, commands)
        self._submit_lazy(self._take_pending(flight))

    def _submit_lazy(self, batch: AppendBatch) -> None:
        """Record without waiting: the batch may share the next admission's commit."""
        self.commits.later(batch).add_done_callback(self._check_append)

    def _stage(self, flight: InFlight, commands: tuple[Any, ...]) -> None:
        """Run commands through the lifecycle rules and keep their events for the next append.
        That append carries the stream version the edge expects, so anyone else writing to this
        request's stream is caught by the store."""
        if not flight.pending:
            flight.pending_from = flight.state.version
        at = self.clock()
        for command in commands:
            for event in lifecycle.decide(flight.state, command):
                flight.pending.append(
                    NewEvent(new_id(), flight.request_id, flight.tenant_id, at, event)
                )
                flight.state = lifecycle.evolve_event(flight.state, event, at)

    def _take_pending(self, flight: InFlight) -> AppendBatch:
        batch = AppendBatch(flight.request_id, flight.pending_from, tuple(flight.pending))
        flight.pending = []
        return batch

    def _check_append(self, future: Any) -> None:
        try:
            result = future.result()
        except Exception as exc:  # the writer itself failed: counted and logged, loudly
            self.metrics.append_failures.inc()
            log.error("event append failed: %r", exc)
            return
        self._count_append(result)

    def _count_append(self, result: AppendResult) -> None:
        if result.ok:
            for r in result.records:
                self.metrics.events_of(r.type).inc()
        else:
            self.metrics.append_failures.inc()
            log.error("event append failed for %s: %s", result.stream_id, result.error)

    def _reject(
        self, request_id: str, caller: Caller, model: str, reason: str, retry_after_s: int,
        detail: str, is_retry: bool,
    ) -> None:
        """A refusal is a fact too: recorded, counted, never silent."""
        self.metrics.rejected.labels(reason, caller.tier).inc()
        event = RequestRejected(
            request_id=request_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
            model=model, tier=caller.tier, reason=reason, retry_after_s=retry_after_s,
            detail=detail[:300], is_retry=is_retry,
        )
        new = NewEvent(new_id(), request_id, caller.tenant_id, self.clock(), event)
        self._submit_lazy(AppendBatch(request_id, 0, (new,)))

    # --- leases --------------------------------------------------------------------------------

    def renew_leases(self) -> None:
        """One LeasesRenewed per edge, carrying each in-flight request's engine counts (and the
        quota view forgets what has aged out of its windows)."""
        self.quota.prune(self.clock())
        live = [f for f in list(self.in_flight.values()) if not f.finished]
        for flight in live:
            if flight.pending:
                self._submit_lazy(self._take_pending(flight))
        if not live:
            return
        progress = tuple(
            LeaseProgress(
                request_id=f.request_id, tenant_id=f.tenant_id,
                prompt_tokens=f.progress.prompt_tokens,
                completion_tokens=f.progress.completion_tokens,
                cached_tokens=f.progress.cached_tokens,
            )
            for f in live
        )
        stream = f"edge-{self.edge_id}"
        event = LeasesRenewed(edge_id=self.edge_id, progress=progress)
        new = NewEvent(new_id(), stream, "", self.clock(), event)
        self._submit_lazy(AppendBatch(stream, None, (new,)))


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


def _replica_error(exc: Exception, headers: dict[str, str], rng: random.Random) -> ApiError:
    if isinstance(exc, ReplicaHTTPError) and 400 <= exc.status < 500 and exc.status != 429:
        err = exc.body.get("error", {}) if isinstance(exc.body, dict) else {}
        err = err if isinstance(err, dict) else {}
        return ApiError(
            exc.status, str(err.get("message") or exc), param=err.get("param"),
            code="engine_rejected", headers=headers,
        )
    return ApiError(
        503, "the model replica is unavailable; retry later", type="capacity",
        code="replica_unavailable",
        headers={**headers, "Retry-After": str(5 + rng.randrange(0, 6))},
    )


def _error_type(reason: str) -> str:
    return {"invalid": "invalid_request_error", "retry_budget": "capacity"}.get(reason, reason)


def _error_code(reason: str) -> str:
    return {
        "invalid": "invalid_value",
        "retry_budget": "retry_budget_exhausted",
    }.get(reason, "rate_limit_exceeded")
