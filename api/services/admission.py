"""Admission, as the one service the edge asks: `admit` answers `Admitted` (the request's flight
and the commands that record its admission) or `Refused` (the error the client gets, already
recorded). Runs (`RunSteps`, run_steps.py), the router (`RoutingStep`, routing_step.py), quota
and hierarchy budgets (`QuotaStep`, quota_step.py: `domain.admission` over
`domain.views.AdmissionViews`), capacity (`Fleet.choose`, `domain.capacity`), fallbacks to
consented models (`FallbackStep`, fallback_step.py) and flex preemption are its steps, applied
in that order; each rule is a pure decision in `domain/` (`domain.admission_steps` beside the
quota's). `settle` gives an ended request's reservations back, `void` one whose admission was
not recorded (both in `settlement.py`).

Nothing here waits on anything remote: the views are local and the fleet's is the last scrape.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import Clock, Fleet, OutputPredictor, Replica, TokenEstimator
from tollgate_llm.api.services import refusal_errors
from tollgate_llm.api.services.adapter_steps import LoraRequest, lora_request
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.fallback_step import FallbackStep
from tollgate_llm.api.services.quota_step import QuotaStep
from tollgate_llm.api.services.recorder import Flight, Recorder
from tollgate_llm.api.services.retention import RETENTION_HEADER
from tollgate_llm.api.services.routing_step import Routing, RoutingStep, request_task_class
from tollgate_llm.api.services.run_steps import RunSteps
from tollgate_llm.api.services.settlement import Settlement
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import AdmissionPolicy
from tollgate_llm.domain.admission_steps import kv_tokens
from tollgate_llm.domain.capacity import AdapterRef, Choice, Refusal, UnknownModel
from tollgate_llm.domain.control_plane.data_policy import ZERO
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Estimate, base_model
from tollgate_llm.domain.feedback import ImplicitSignals
from tollgate_llm.domain.prediction import SYSTEM_PROMPT_BUCKETS, RequestShape
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    AskToPreempt,
    Command,
    CompleteRequest,
    RouteRequest,
)
from tollgate_llm.domain.routing import AUTO, QualityView
from tollgate_llm.domain.runs.state import Run
from tollgate_llm.domain.views import AdmissionViews
from tollgate_llm.engine_adapter.usage import Progress

if TYPE_CHECKING:
    from tollgate_llm.api.services.tracing import RequestTrace

__all__ = ["Admission", "Admitted", "Refused"]

# How a refusal is recorded (`Edge._reject`: metrics, the refusal sampler, the recorder):
# (request id, caller, model, reason, retry after s, detail, is retry).
Reject = Callable[[str, Caller, str, str, int, str, bool], None]
# How flex requests this edge serves are preempted (`Edge.preempt`): (their ids, for whom).
Preempt = Callable[[tuple[str, ...], str], None]

_Routed = Choice[Replica] | Refusal | UnknownModel


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admitted: the request's flight (its quota charged, its replica chosen) and the commands
    that make the admission durable (`Recorder.commit`)."""

    flight: Flight
    commands: tuple[Command, ...]


@dataclass(frozen=True, slots=True)
class Refused:
    """Refused, and the refusal recorded: `error` is what the client gets."""

    error: ApiError


class Admission:
    def __init__(
        self,
        *,
        control: ControlView,
        views: AdmissionViews,
        fleet: Fleet,
        metrics: Metrics,
        tokens: Callable[[str], TokenEstimator],
        recorder: Recorder,
        reject: Reject,
        preempt: Preempt,
        edge_id: str,
        rng: random.Random,
        clock: Clock,
        policy: AdmissionPolicy,
        predictor: OutputPredictor | None,
        tpot_target_us: int,
        quality: QualityView | None = None,
        signals: ImplicitSignals | None = None,
    ) -> None:
        self.control = control
        self.views = views
        self.fleet = fleet
        self.metrics = metrics
        self.recorder = recorder
        self.reject = reject
        self.preempt = preempt
        self.edge_id = edge_id
        self.rng = rng
        self.clock = clock
        # The router's step; `quality` is the tenants' feedback folded (ledger/quality.py keeps
        # it current), `signals` what this edge remembers for the implicit feedback.
        self.router = RoutingStep(
            control=control, quality=quality or QualityView(), tokens=tokens,
            resolve=self.resolve_model, reject=reject, fact=recorder.fact, metrics=metrics,
            rng=rng, clock=clock, signals=signals,
        )  # fmt: skip
        self.runs = RunSteps(control=control, views=views, recorder=recorder, clock=clock)
        self.quota = QuotaStep(
            control=control, views=views, fleet=fleet, metrics=metrics, tokens=tokens,
            edge_id=edge_id, rng=rng, clock=clock, policy=policy, predictor=predictor,
            tpot_target_us=tpot_target_us,
        )
        self.fallbacks = FallbackStep(
            control=control, views=views, quota=self.quota, route=self._route,
            router=self.router, resolve=self.resolve_model, reject=reject, metrics=metrics,
            rng=rng, policy=policy,
        )
        self.settlement = Settlement(
            control=control, views=views, fleet=fleet, predictor=predictor, clock=clock
        )

    @property
    def predictor(self) -> OutputPredictor | None:
        """One for both ends of an admission, the question and the lesson (`Settlement`), and
        replaced while serving when a new model is loaded (`Edge.predictor`)."""
        return self.settlement.predictor

    @predictor.setter
    def predictor(self, predictor: OutputPredictor | None) -> None:
        self.settlement.predictor = self.quota.predictor = predictor

    # --- the models on sale --------------------------------------------------------------------

    def models(self) -> list[str]:
        """Model versions on sale: served by the fleet and priced now. An unpriced model could
        never be billed, so it is not offered (and the billing fold never meets one)."""
        now = self.clock()
        return [m for m in self.fleet.models() if self.control.has_price(m, now)]

    def resolve_model(self, requested: str, caller: Caller | None = None) -> str | None:
        """A pinned version is served as is (if on sale); a base name goes to its newest
        version on sale; `auto` is the router's, decided with the caller's consent in `admit`;
        the name of one of the caller's LoRA adapters is itself (`adapter_steps`)."""
        if requested == AUTO:
            return AUTO
        if requested in self.fleet.serves:  # a version: no need to list every model on sale
            return requested if self.control.has_price(requested, self.clock()) else None
        versions = [m for m in self.models() if base_model(m) == requested]
        if versions:
            return max(versions)
        if caller is not None and lora_request(self.control, caller, requested, self.resolve_model):
            return requested
        return None

    # --- the one question ----------------------------------------------------------------------

    def admit(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str,
        idempotency_key: str | None, is_retry: bool, headers: dict[str, str],
        run_id: str | None = None, trace: RequestTrace | None = None,
    ) -> Admitted | Refused:  # fmt: skip
        """Runs, the router, quota, capacity, then fallbacks (`FallbackStep`: only to a model
        its tenant consented to): the flight and the commands that record its admission, or the
        refusal as the client will see it (and recorded). `headers` (the response's) get the
        rate limits, where a request was routed or downgraded from, and a zero-retention
        tenant's `X-Tollgate-Retention: zero`. A pinned tenant is served only in its regions."""
        regions = self.control.regions(caller.tenant_id, caller.key_id)
        retention = self.control.retention(caller.tenant_id, caller.key_id)
        if retention == ZERO:
            headers[RETENTION_HEADER] = ZERO
        bucket = system_prompt_bucket(caller, req)
        run = None if run_id is None else self.runs.resolve(caller, run_id)
        lora: LoraRequest | None = None
        if model != AUTO and model not in self.fleet.serves:  # one of the caller's adapters
            lora = lora_request(self.control, caller, model, self.resolve_model)
            if lora is None:  # revoked since the edge resolved it
                return self._unknown(caller, model, request_id, is_retry)
            model = lora.model
        routing = self.router.route(caller, req, model, request_id, is_retry, bucket, run)
        if isinstance(routing, ApiError):
            return Refused(routing)
        model = model if routing is None else routing.routed.served_model
        decision, shape = self.quota.reserve(
            caller, req, model, request_id, is_retry, bucket, run,
            counted=None if routing is None else routing.counted,
            lora_rank=lora and lora.adapter.rank,
        )  # fmt: skip
        if trace is not None:
            trace.quota_decided(decision)
        headers.update(refusal_errors.rate_limit_headers(decision.rate_limits))
        if isinstance(decision, admission.Rejected):
            return self._quota_refused(caller, model, request_id, is_retry, run, decision, headers)
        choice = self._route(
            model, caller.tier, decision.estimate, req.service_tier, request_id, trace, regions,
            lora and lora.ref,
        )  # fmt: skip
        if isinstance(choice, Choice):
            if routing is not None:
                self.router.label(headers, routing)
            return self._admitted(
                caller, req, request_id, idempotency_key, is_retry, bucket, run, decision,
                shape, choice, model, routing=routing, retention=retention,
                adapter=lora.adapter.name if lora else "",
            )  # fmt: skip
        other = self.fallbacks.no_room(
            caller, req, model, request_id, is_retry, headers, bucket, run, trace, routing,
            choice, regions, lora.adapter.name if lora else model,
        )  # fmt: skip
        if isinstance(other, ApiError):
            return Refused(other)
        return self._admitted(
            caller, req, request_id, idempotency_key, is_retry, bucket, run, other.decision,
            other.shape, other.choice, other.served, downgraded_from=other.downgraded_from,
            reason=other.reason, routing=other.routing, retention=retention,
        )  # fmt: skip

    def _quota_refused(
        self, caller: Caller, model: str, request_id: str, is_retry: bool, run: Run | None,
        decision: admission.Rejected, headers: dict[str, str],
    ) -> Refused:  # fmt: skip
        """Refused by quota or a budget, and recorded; a run's budget exhausted is recorded on
        the first refusal of its dimension (and the router told, for its implicit feedback)."""
        self.reject(
            request_id, caller, model, decision.reason, decision.retry_after_s, decision.detail,
            is_retry,
        )  # fmt: skip
        exhausted = decision.reason == "run_budget" and run is not None
        if exhausted and self.runs.exhausted(run, decision.dimension or "", request_id):
            self.router.run_exhausted(run)
        return Refused(refusal_errors.refusal(decision, headers))

    def _unknown(self, caller: Caller, model: str, request_id: str, is_retry: bool) -> Refused:
        """The answer a model that does not exist gets (the edge's own, for a name it could
        not resolve): one word for every reason, so that nothing tells whose a name is."""
        self.reject(request_id, caller, model, "invalid", 0, "unknown model", is_retry)
        return Refused(ApiError(
            404, f"The model `{model}` does not exist or you do not have access to it.",
            param="model", code="model_not_found",
        ))  # fmt: skip

    def _admitted(
        self, caller: Caller, req: ChatRequest, request_id: str, idempotency_key: str | None,
        is_retry: bool, bucket: int, run: Run | None, decision: admission.Admitted,
        shape: RequestShape | None, choice: Choice[Replica], served: str, *,
        downgraded_from: str | None = None, reason: str = "", routing: Routing | None = None,
        retention: str = "", adapter: str = "",
    ) -> Admitted:  # fmt: skip
        """The admitted request's flight; the flex work its replica gives up is preempted, and
        the run it starts is recorded."""
        flight = Flight(
            request_id, caller.tenant_id, served, caller.tier, Progress(), choice,
            idempotency_key=idempotency_key, shape=shape, service_tier=req.service_tier,
            retention=retention,
        )
        if req.service_tier == "flex":
            self.metrics.flex_of(served, caller.tier, "admitted").inc()
        if choice.preempt:
            # Their KV is this request's: abort them now, without waiting for the aborts (the
            # engine serves this one first meanwhile: it has the lower `priority`).
            self.preempt(choice.preempt, request_id)
            if choice.preempt_remote:
                self._ask_to_preempt(choice.preempt_remote, request_id, choice.replica_id)
            self.metrics.preemptions_of(served, caller.tier).inc()
        if decision.starts_run and run is not None and run.implicit:
            self.runs.started(run)
        cls = request_task_class(req, bucket, decision.estimate.prompt_tokens, run)
        model_routed = None
        if routing is not None:
            cls = routing.routed.task_class  # as the router saw it: feedback lands where it looked
            model_routed = routing.event(request_id)
        self.router.admitted(caller, req, request_id, served, cls, routing, run)
        return Admitted(flight, (
            AdmitRequest(
                request_id=request_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
                model=served, tier=caller.tier, edge_id=self.edge_id,  # type: ignore[arg-type]
                estimate=decision.estimate, idempotency_key=idempotency_key,
                is_retry=is_retry, stream=req.stream, downgraded_from=downgraded_from,
                downgrade_reason=reason if downgraded_from else "",
                message_count=len(req.messages),
                system_prompt_bucket=bucket,
                service_tier=req.service_tier,  # type: ignore[arg-type]
                reserved=decision.reserved,
                batch_item=req.batch_item,
                task_class=cls,
                routed=model_routed,
                retention=retention,
                adapter=adapter,
                end_user=req.end_user_hash,
            ),
            RouteRequest(
                request_id=request_id, replica_id=choice.replica_id,
                occupancy_ppm=choice.occupancy_ppm, region=choice.region,
            ),
        ))  # fmt: skip

    # --- capacity ------------------------------------------------------------------------------

    def _route(
        self, model: str, tier: str, estimate: Estimate, service_tier: str, request_id: str,
        trace: RequestTrace | None = None, regions: frozenset[str] | None = None,
        adapter: AdapterRef | None = None,
    ) -> _Routed:  # fmt: skip
        started = 0 if trace is None else trace.now()
        choice = self.fleet.choose(
            model, tier, kv_tokens(estimate), self.rng, service_tier=service_tier,
            request_id=request_id, regions=regions, adapter=adapter,
        )
        if trace is not None:
            trace.routed(started, model, choice)
        return choice

    def _ask_to_preempt(
        self, request_ids: tuple[str, ...], for_request_id: str, replica_id: str
    ) -> None:
        """Flex requests another edge serves: ask for their preemption on their streams (in the
        background: this request goes to the engine now, ahead of them by priority). Their edge
        follows the log and preempts them within one poll of the append."""
        others = self.views.others_flex
        for request_id in request_ids:
            tenant_id = others.tenant_of(request_id)
            if tenant_id is None or not others.ask(request_id):
                continue
            command = AskToPreempt(
                requested_by=self.edge_id, preempted_for=for_request_id, replica_id=replica_id,
                request_id=request_id,
            )
            self.recorder.ask(request_id, tenant_id, command)

    # --- the end of an admission (services/settlement.py) ------------------------------------

    def void(self, flight: Flight) -> None:
        """Its admission was not recorded: `Settlement.void`."""
        self.settlement.void(flight)
        self.router.ended(flight.request_id, completed=False)

    def settle(self, flight: Flight, command: Command) -> None:
        """The request ended (`command`, its terminal): `Settlement.settle`."""
        self.settlement.settle(flight, command)
        self.router.ended(flight.request_id, completed=isinstance(command, CompleteRequest))


def system_prompt_bucket(caller: Caller, req: ChatRequest) -> int:
    """The system prompt as a number the predictor may learn from: a hash keyed by the tenant,
    modulo 64, so it says nothing of the text and one tenant's bucket 7 is unrelated to
    another's. -1 when the chat has no system (or developer) message first."""
    first = req.messages[0] if req.messages else None
    if not isinstance(first, dict) or first.get("role") not in ("system", "developer"):
        return -1
    digest = hashlib.blake2b(
        orjson.dumps(first.get("content")), digest_size=8,
        key=caller.tenant_id.encode()[:64],
    ).digest()
    return int.from_bytes(digest) % SYSTEM_PROMPT_BUCKETS
