"""Admission, as the one service the edge asks: `admit` answers `Admitted` (the request's flight
and the commands that record its admission) or `Refused` (the error the client gets, already
recorded). Quota and hierarchy budgets (`domain.admission` over `domain.views.AdmissionViews`),
runs, the router (`RoutingStep`, api/services/routing_step.py), capacity (`Fleet.choose`,
`domain.capacity`), fallbacks to consented models and flex preemption are its steps, applied in
that order; each rule is a pure decision in `domain/`
(`domain.admission_steps` beside the quota's). `settle` gives an ended request's reservations
back, `void` one whose admission was not recorded (both in `settlement.py`).

Nothing here waits on anything remote: the views are local and the fleet's is the last scrape.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from api.metrics import Metrics
from api.ports import Clock, Fleet, OutputPredictor, Replica, TokenEstimator
from api.services import refusal_errors
from api.services.adapter_steps import LoraRequest, lora_request
from api.services.auth import Caller
from api.services.chat_request import ChatRequest
from api.services.errors import ApiError
from api.services.recorder import Flight, Recorder
from api.services.retention import RETENTION_HEADER
from api.services.routing_step import Routing, RoutingStep, request_task_class
from api.services.run_steps import RunSteps
from api.services.settlement import Settlement
from domain import admission
from domain.admission import AdmissionPolicy
from domain.admission_steps import (
    capacity_detail,
    fallback_models,
    kv_tokens,
    may_fall_back,
)
from domain.capacity import AdapterRef, Choice, Refusal, UnknownModel
from domain.control_plane.adapters import adapter_tpot_us
from domain.control_plane.data_policy import ZERO
from domain.control_plane.state import ControlView
from domain.cost import Estimate, base_model, tpot_estimate_us
from domain.feedback import ImplicitSignals
from domain.prediction import SYSTEM_PROMPT_BUCKETS, Prediction, RequestShape
from domain.requests.decide import (
    AdmitRequest,
    AskToPreempt,
    Command,
    CompleteRequest,
    RouteRequest,
)
from domain.residency import refusal_detail
from domain.routing import AUTO, QualityView
from domain.runs.state import Run
from domain.views import AdmissionViews
from engine_adapter.usage import Progress

if TYPE_CHECKING:
    from api.services.tracing import RequestTrace

__all__ = ["Admission", "Admitted", "Refused"]

# How a refusal is recorded (`Edge._reject`: metrics, the refusal sampler, the recorder):
# (request id, caller, model, reason, retry after s, detail, is retry).
Reject = Callable[[str, Caller, str, str, int, str, bool], None]
# How flex requests this edge serves are preempted (`Edge.preempt`): (their ids, for whom).
Preempt = Callable[[tuple[str, ...], str], None]

_Routed = Choice[Replica] | Refusal | UnknownModel
_Decision = admission.Admitted | admission.Rejected


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
        self.tokens = tokens
        self.recorder = recorder
        self.reject = reject
        self.preempt = preempt
        self.edge_id = edge_id
        self.rng = rng
        self.clock = clock
        self.policy = policy
        self.tpot_target_us = tpot_target_us
        # The router's step; `quality` is the tenants' feedback folded (ledger/quality.py keeps
        # it current), `signals` what this edge remembers for the implicit feedback.
        self.router = RoutingStep(
            control=control, quality=quality or QualityView(), tokens=tokens,
            resolve=self.resolve_model, reject=reject, fact=recorder.fact, metrics=metrics,
            rng=rng, clock=clock, signals=signals,
        )  # fmt: skip
        self.runs = RunSteps(control=control, views=views, recorder=recorder, clock=clock)
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
        self.settlement.predictor = predictor

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
        """Quota, then capacity: an admitted request's flight and the commands that record its
        admission, or the refusal as the client will see it (and recorded). `headers` (the
        response's) get the rate limits, and the model a request was downgraded from.

        When no replica of the model can take the request and the tenant consented to another
        model (`tollgate fallbacks allow`), that one is tried, under its own quota; without
        consent no other model is ever served.

        A tenant pinned to regions (`tollgate residency set`) is routed only there, the
        fallback included, and refused `region_unavailable` when they have no room; a
        zero-retention one's responses say so (`X-Tollgate-Retention: zero`)."""
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
        if routing is not None:
            model = routing.routed.served_model
        decision, shape = self._reserve(
            caller, req, model, request_id, is_retry, bucket, run,
            counted=None if routing is None else routing.counted,
            lora_rank=lora and lora.adapter.rank,
        )  # fmt: skip
        if trace is not None:
            trace.quota_decided(decision)
        headers.update(refusal_errors.rate_limit_headers(decision.rate_limits))
        if isinstance(decision, admission.Rejected):
            self.reject(
                request_id, caller, model, decision.reason, decision.retry_after_s,
                decision.detail, is_retry,
            )
            exhausted = decision.reason == "run_budget" and run is not None
            if exhausted and self.runs.exhausted(run, decision.dimension or "", request_id):
                self.router.run_exhausted(run)
            return Refused(refusal_errors.refusal(decision, headers))
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
        if not may_fall_back(req.service_tier):
            if regions is None:
                return self._flex_refused(caller, model, request_id, is_retry, headers, choice)
            # A pinned tenant's flex refusal says, like its other ones, that its regions had
            # no room: what it must know is that nothing ran elsewhere.
            self.metrics.flex_of(model, caller.tier, "refused").inc()
        self.views.void(request_id)
        return self._no_room(
            caller, req, model, request_id, idempotency_key, is_retry, headers, bucket, run,
            trace, routing, capacity_detail(choice), regions, retention,
            lora.adapter.name if lora else model,
        )  # fmt: skip

    def _no_room(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str,
        idempotency_key: str | None, is_retry: bool, headers: dict[str, str], bucket: int,
        run: Run | None, trace: RequestTrace | None, routing: Routing | None, reason: str,
        regions: frozenset[str] | None, retention: str, asked: str,
    ) -> Admitted | Refused:  # fmt: skip
        """No replica of `model` takes the request: a routed one sheds to its reference model
        (per policy); another goes to a model the tenant consented to (`tollgate fallbacks
        allow`) from `asked` (an adapter's name: its base model without the adapter is another
        model), else it is the capacity refusal (`region_unavailable` for a pinned tenant)."""
        if routing is not None:
            return self._shed(
                caller, req, request_id, idempotency_key, is_retry, headers, bucket, run, trace,
                routing, reason, regions, retention,
            )  # fmt: skip
        fallback = None if not may_fall_back(req.service_tier) else self._fall_back(
            caller, req, asked, request_id, is_retry, headers, bucket, run, trace, regions=regions
        )  # fmt: skip
        if fallback is None:
            retry_after = self.policy.backoff.retry_after_s(self.rng.random())
            detail = refusal_detail(reason, regions)
            self.reject(request_id, caller, model, "capacity", retry_after, detail, is_retry)
            if regions is not None:
                return Refused(
                    refusal_errors.region_unavailable(model, regions, retry_after, headers)
                )
            return Refused(
                refusal_errors.no_capacity(model, caller.tier, reason, retry_after, headers)
            )
        served, decision, shape, choice = fallback
        return self._admitted(
            caller, req, request_id, idempotency_key, is_retry, bucket, run, decision, shape,
            choice, served, downgraded_from=asked, reason=reason, retention=retention,
        )  # fmt: skip

    def _unknown(self, caller: Caller, model: str, request_id: str, is_retry: bool) -> Refused:
        """The answer a model that does not exist gets (the edge's own, for a name it could
        not resolve): one word for every reason, so that nothing tells whose a name is."""
        self.reject(request_id, caller, model, "invalid", 0, "unknown model", is_retry)
        return Refused(ApiError(
            404, f"The model `{model}` does not exist or you do not have access to it.",
            param="model", code="model_not_found",
        ))  # fmt: skip

    def _flex_refused(
        self, caller: Caller, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], refused: Refusal | UnknownModel,
    ) -> Refused:  # fmt: skip
        """Flex takes idle capacity or nothing: no other model, and the refusal is OpenAI's
        flex 429 (not billed), recorded as a capacity refusal like any other."""
        self.views.void(request_id)
        reason = capacity_detail(refused)
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        self.metrics.flex_of(model, caller.tier, "refused").inc()
        self.reject(request_id, caller, model, "capacity", retry_after, reason, is_retry)
        return Refused(refusal_errors.flex_unavailable(model, reason, retry_after, headers))

    def _fall_back(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], bucket: int, run: Run | None, trace: RequestTrace | None,
        alternatives: list[str] | None = None,
        regions: frozenset[str] | None = None,
    ) -> tuple[str, admission.Admitted, RequestShape | None, Choice[Replica]] | None:
        """The first consented model whose own quota admits the request and that a replica
        takes: (that model, its quota decision, the predictor's question, the replica).
        `alternatives`: those models instead of the consented fallbacks (the router's shedding:
        not a downgrade)."""
        downgrade = alternatives is None
        if alternatives is None:
            given = self.control.fallback_book.fallbacks(caller.tenant_id, model)
            consented = (self.resolve_model(m) for m in given)
            alternatives = fallback_models(model, consented)
        for alternative in alternatives:
            self.views.withdraw(request_id)
            other, shape = self._reserve(
                caller, req, alternative, request_id, is_retry, bucket, run
            )
            if isinstance(other, admission.Rejected):
                continue  # its own quota is spent: the next consented model, or a 503
            choice = self._route(
                alternative, caller.tier, other.estimate, "default", request_id, trace, regions
            )
            if isinstance(choice, Choice):
                headers.update(refusal_errors.rate_limit_headers(other.rate_limits))
                if downgrade:
                    headers["X-Tollgate-Downgraded-From"] = model
                    self.metrics.downgraded.labels(model, alternative).inc()
                return alternative, other, shape, choice
            self.views.void(request_id)
        return None

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
            ),
            RouteRequest(
                request_id=request_id, replica_id=choice.replica_id,
                occupancy_ppm=choice.occupancy_ppm, region=choice.region,
            ),
        ))  # fmt: skip

    def _shed(
        self, caller: Caller, req: ChatRequest, request_id: str, idempotency_key: str | None,
        is_retry: bool, headers: dict[str, str], bucket: int, run: Run | None,
        trace: RequestTrace | None, routing: Routing, reason: str,
        regions: frozenset[str] | None, retention: str,
    ) -> Admitted | Refused:  # fmt: skip
        """The routed model had no room: the reference model serves it, through its own quota
        and capacity like any request (in the tenant's regions), when the policy says so
        (`on_capacity` "asked"); else, or when it has no room either, the capacity refusal any
        request gets."""
        served, reference = routing.routed.served_model, routing.routed.reference_model
        if routing.policy.on_capacity == "asked" and served != reference:
            shed = self._fall_back(
                caller, req, served, request_id, is_retry, headers, bucket, run, trace,
                alternatives=[reference], regions=regions,
            )  # fmt: skip
            if shed is not None:
                model, decision, shape, replica = shed
                routing = self.router.shed(routing, caller.tenant_id)
                self.router.label(headers, routing)
                return self._admitted(
                    caller, req, request_id, idempotency_key, is_retry, bucket, run, decision,
                    shape, replica, model, routing=routing, retention=retention,
                )  # fmt: skip
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        detail = refusal_detail(reason, regions)
        self.reject(request_id, caller, served, "capacity", retry_after, detail, is_retry)
        if regions is not None:
            return Refused(refusal_errors.region_unavailable(served, regions, retry_after, headers))
        refused = refusal_errors.no_capacity(served, caller.tier, reason, retry_after, headers)
        return Refused(refused)

    # --- quota ---------------------------------------------------------------------------------

    def _reserve(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        system_prompt_bucket: int, run: Run | None = None,
        counted: tuple[TokenEstimator, int] | None = None, lora_rank: int | None = None,
    ) -> tuple[_Decision, RequestShape | None]:
        """The quota decision for serving `req` with `model` (charged to the views if
        admitted), and what the output predictor was asked about it. `counted`: the prompt
        already counted (by the router), taken when `model`'s estimator is the one that did.
        `lora_rank`: served through an adapter of that rank, whose matrices stretch each decode
        step (`adapter_tpot_us`): the base model's KV is held that much longer."""
        measured = self.fleet.tpot_p95(model)
        limits = self.control.limits(caller.tenant_id, model)
        estimator = self.tokens(model)
        prompt_tokens = (
            counted[1] if counted is not None and counted[0] is estimator
            else estimator.prompt_tokens(req.messages, req.upstream.get("tools"))
        )  # fmt: skip
        now = self.clock()
        shape = predicted = None
        if self.predictor is not None:
            shape = RequestShape(
                caller.tenant_id, caller.key_id, model, prompt_tokens,
                admission.output_cap(req.max_tokens, limits), len(req.messages),
                system_prompt_bucket, now,
            )
            answer = self.predictor.predict(shape)
            if isinstance(answer, Prediction):
                predicted = answer
            self.metrics.count_prediction(caller.tenant_id, None if predicted else str(answer))
        cmd = admission.ReserveQuota(
                request_id=request_id,
                tenant_id=caller.tenant_id,
                key_id=caller.key_id,
                model=model,
                tier=caller.tier,
                edge_id=self.edge_id,
                prompt_tokens=prompt_tokens,
                max_tokens=req.max_tokens,
                min_tokens=req.upstream.get("min_tokens"),
                kv_bytes_per_token=self.control.model_profile(model).kv_bytes_per_token,
                tpot_us=adapter_tpot_us(tpot_estimate_us(
                    measured.p95_us if measured else None,
                    measured.age_s if measured else None,
                    self.tpot_target_us,
                ), lora_rank or 0),
                now=now,
                jitter=self.rng.random(),
                is_retry=is_retry,
                predicted_output_tokens=predicted.output_tokens if predicted else None,
                predictor_version=predicted.model_version if predicted else "",
                context_tokens=self.fleet.context_tokens(model),
        )  # fmt: skip
        path = self.control.hierarchy.policy(caller.tenant_id, caller.key_id, model, now, run)
        price = lambda: self.control.price(model, now)  # noqa: E731 - only on a path
        return self.views.charge(cmd, limits, path, price, self.policy), shape

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
