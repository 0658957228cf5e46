"""The customer path, as an application service over ports: parse, resolve the model, ask
`Admission` (quota, budgets, runs, capacity, fallbacks, flex preemption: api/services/admission.py),
record the admission, relay the generation (`api/services/relay.py` for a stream), and end every
admitted request with exactly one terminal event and its refund (`api/services/flights.py`).

The rules it applies are `domain`'s (admission, capacity, lifecycle, backoff); the facts go
through the `Recorder`; the engine, the fleet, the token count, the clock and the ids are ports
(`api/ports.py`), so the whole path runs in a unit test with fakes. Nothing here waits on
anything remote before the admission decision: the views are local and the fleet view is the
last scrape.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import EventSink, Fleet, Idempotency, OutputPredictor, TokenEstimator
from tollgate_llm.api.services.adapter_steps import LoraRequest, listed_adapters
from tollgate_llm.api.services.admission import Admission, Refused
from tollgate_llm.api.services.auth import Authenticator, Caller
from tollgate_llm.api.services.chat_request import ChatRequest, parse_chat_request
from tollgate_llm.api.services.completion import JsonCompletion, JsonOutcome
from tollgate_llm.api.services.end_user_step import identify
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.flights import (
    Flights,
    cancel_command,
    committed,
)
from tollgate_llm.api.services.idempotency_service import replay_frames
from tollgate_llm.api.services.outcomes import Outcomes
from tollgate_llm.api.services.recorder import Flight, Recorder
from tollgate_llm.api.services.relay import StreamOutcome, StreamRelay
from tollgate_llm.domain.admission import DEFAULT_POLICY, AdmissionPolicy
from tollgate_llm.domain.backoff import engine_priority
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.leases import LEASE_KEEPALIVE_S
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.refusals import RefusalSampler
from tollgate_llm.domain.remote_flex import RemoteFlex
from tollgate_llm.domain.requests.decide import Command
from tollgate_llm.domain.requests.events import PreemptionRequested
from tollgate_llm.domain.routing import QualityView
from tollgate_llm.domain.views import AdmissionViews
from tollgate_llm.engine_adapter.exchange import MAX_BUFFERED_CHUNKS
from tollgate_llm.ledger.commands import CommandHandler
from tollgate_llm.ledger.ids import Clock, IdSource, new_event_id, utcnow
from tollgate_llm.ledger.store import AppendResult

if TYPE_CHECKING:
    from tollgate_llm.api.services.tracing import RequestTrace

__all__ = ["Caller", "Edge", "JsonOutcome", "StreamOutcome"]


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
        quality: QualityView | None = None,
    ) -> None:
        """The ports arrive from the composition root (api/runtime.py; fakes in the unit
        tests); the services of the path are put together here, each given what it uses."""
        self.control = control
        self.fleet = fleet
        self._idempotency = idempotency
        self.metrics = metrics
        self.edge_id = edge_id
        self.rng = rng = rng or random.Random()
        self.clock = clock
        self.policy = policy
        self.views = _admission_views(quota, paths, policy, edge_id, lambda: self.control)
        self.auth = Authenticator(control)
        self.recorder = Recorder(events, metrics, clock=clock, new_id=new_id, commands=commands)
        self.outcomes = Outcomes(
            control=control, metrics=metrics, recorder=self.recorder,
            refusals=refusals or RefusalSampler(), clock=clock,
        )
        self.admission = Admission(
            control=control, views=self.views, fleet=fleet, metrics=metrics, tokens=tokens,
            recorder=self.recorder, reject=self.outcomes.reject, preempt=self.preempt,
            edge_id=edge_id, rng=rng, clock=clock, policy=policy, predictor=predictor,
            tpot_target_us=tpot_target_us, quality=quality or QualityView(),
        )
        self.flights = Flights(
            admission=self.admission, recorder=self.recorder, outcomes=self.outcomes,
            metrics=metrics, idempotency=idempotency, clock=clock, edge_id=edge_id,
            slow_reader_s=slow_reader_s,
            retry_after_s=lambda: policy.backoff.retry_after_s(rng.random()),
        )
        self.relay = StreamRelay(
            self.flights, idempotency, stream_buffer_chunks=stream_buffer_chunks
        )
        self.completion = JsonCompletion(self.flights, idempotency)
        self.in_flight: dict[str, Flight] = self.flights.in_flight
        self._keepalive_at: datetime | None = None  # the last renewal of every lease

    # --- what the runtime and the tests read of its parts --------------------------------------

    @property
    def idempotency(self) -> Idempotency:
        return self._idempotency

    @idempotency.setter
    def idempotency(self, idempotency: Idempotency) -> None:
        self._idempotency = idempotency
        self.flights.idempotency = self.relay.idempotency = idempotency
        self.completion.idempotency = idempotency

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

    def preempt(self, request_ids: tuple[str, ...], for_request_id: str) -> None:
        """Abort these flex requests at their engine, for `for_request_id` (`Flights.preempt`)."""
        self.flights.preempt(request_ids, for_request_id)

    def check_slow_readers(self, now: float) -> None:
        self.flights.check_slow_readers(now)

    def record_counted_refusals(self, *, everything: bool = False) -> int:
        return self.outcomes.record_counted_refusals(everything=everything)

    # --- the log, the caller, the models on sale -----------------------------------------------

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
                self.flights.preemption_requested(record)

    def authenticate(self, authorization: str | None, scopes: frozenset[str]) -> Caller:
        return self.auth.authenticate(authorization, scopes)

    def models(self) -> list[str]:
        return self.admission.models()

    def resolve_model(self, requested: str, caller: Caller | None = None) -> str | None:
        return self.admission.resolve_model(requested, caller)

    def adapters(self, caller: Caller) -> list[LoraRequest]:
        """The caller's own LoRA adapters it may ask for, each with the base version serving it
        (never another tenant's)."""
        return listed_adapters(self.admission.control, caller, self.admission.resolve_model)

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
        trace: RequestTrace | None = None,
        end_user: str | None = None,
    ) -> JsonOutcome | StreamOutcome:
        """One chat completion. `batch_item` ("<batch id>/<custom_id>"): the batch runner sends
        it, and it runs in the flex class whatever the body asks. `trace`: its spans, when
        tracing is on (api/services/tracing.py). `end_user`: the X-Tollgate-End-User header,
        which names the caller's customer over the body's `user` (api/services/end_user_step.py)."""
        headers = {"X-Request-Id": request_id}
        req, model = self._request(caller, raw, request_id, retry_count, batch_item)
        identify(caller, req, end_user)
        if idempotency_key is not None:
            req.body_sha256 = hashlib.sha256(raw).hexdigest()
            replay = await self._replay(caller, idempotency_key, req.body_sha256)
            if replay is not None:
                return replay
        is_retry = retry_count > 0 or self.idempotency.seen_recently(
            caller.tenant_id, idempotency_key
        )
        if trace is not None:
            trace.admitting()
        answer = self.admission.admit(
            caller, req, model, request_id, idempotency_key, is_retry, headers, run_id, trace
        )
        if trace is not None:
            trace.admitted(answer)
        if isinstance(answer, Refused):
            raise answer.error
        flight = answer.flight
        if trace is None:
            await self._record_admission(flight, caller, req, answer.commands)
        else:
            flight.trace = trace
            started = trace.now()
            commands = trace.on_admission(answer.commands)
            try:
                await self._record_admission(flight, caller, req, commands)
            finally:
                trace.recorded_admission(started, flight.request_id in self.flights.in_flight)
        body = dict(req.upstream)
        body["priority"] = engine_priority(caller.tier, req.service_tier)
        body["max_tokens"] = flight.state.output_cap_tokens
        if req.stream:
            return await self.relay.open(flight, caller, req, body, headers)
        return await self.completion.complete(flight, caller, body, headers)

    def _request(
        self, caller: Caller, raw: bytes, request_id: str, retry_count: int, batch_item: str
    ) -> tuple[ChatRequest, str]:
        """The body parsed and its model resolved to one on sale; a refusal (recorded) if not."""
        try:
            req = parse_chat_request(raw)
        except ApiError as exc:
            self.outcomes.reject(request_id, caller, "", "invalid", 0, exc.message, retry_count > 0)
            raise
        if batch_item:
            req.service_tier, req.batch_item = "flex", batch_item
        model = self.resolve_model(req.model, caller)
        if model is None:
            self.outcomes.reject(
                request_id, caller, req.model, "invalid", 0, "unknown model", False
            )
            raise ApiError(
                404, f"The model `{req.model}` does not exist or you do not have access to it.",
                param="model", code="model_not_found",
            )
        return req, model

    async def _replay(
        self, caller: Caller, key: str, body_sha256: str
    ) -> JsonOutcome | StreamOutcome | None:
        """The answer kept for this Idempotency-Key and body, when there is one."""
        stored = await self.idempotency.lookup(caller.tenant_id, key, body_sha256)
        if stored is None:
            return None
        headers = {**stored.headers, "Idempotent-Replayed": "true"}
        if stored.content_type == "text/event-stream":
            return StreamOutcome(headers, replay_frames(stored.body))
        return JsonOutcome(stored.status, stored.body, headers)

    async def _record_admission(
        self, flight: Flight, caller: Caller, req: ChatRequest,
        commands: tuple[Command, ...],
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
            if isinstance(exc, asyncio.CancelledError) and await committed(committing):
                # The client left while its admission was being committed, and it committed:
                # the request is admitted, so it ends here, cancelled (not by lease expiry 15 s
                # later, with its quota held meanwhile).
                self.flights.track(flight)
                self.flights.end(flight, cancel_command(flight.progress))
            else:
                self.admission.void(flight)
            if began:  # the key is ours: free it (never another request's in-flight key)
                await self.idempotency.abandon(caller.tenant_id, key or "")
            raise
        self.flights.track(flight)

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
            self.outcomes.record_counted_refusals()
        self.recorder.renew(self.edge_id, list(self.flights.in_flight.values()), everyone=keepalive)


def _admission_views(
    quota: QuotaView, paths: PathView | None, policy: AdmissionPolicy, edge_id: str,
    control: Callable[[], ControlView],
) -> AdmissionViews:  # fmt: skip
    """The quota, every level below the organization and the runs (domain.governance.budgets),
    and the flex work other edges serve: one facade, kept in step by `domain.views`. The path
    view's buckets of levels it has not decided on yet are sized from the hierarchy when another
    edge's admission there is folded (`Edge.observe`)."""
    return AdmissionViews(
        quota,
        paths or PathView(
            backoff=policy.backoff,
            rates_for=lambda *level: control().hierarchy.level_rates(*level),
        ),
        RemoteFlex(edge_id),
    )  # fmt: skip
