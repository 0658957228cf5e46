"""Admission, as the one service the edge asks: `admit` answers `Admitted` (the request's flight
and the commands that record its admission) or `Refused` (the error the client gets, already
recorded). Quota and hierarchy budgets (`domain.admission` over `domain.views.AdmissionViews`),
runs, the router (`RoutingStep`, api/services/routing_step.py), capacity (`Fleet.choose`,
`domain.capacity`), fallbacks to consented models and flex preemption are its steps, applied in
that order; each rule is a pure decision in `domain/`
(`domain.admission_steps` beside the quota's). `settle` gives an ended request's reservations
back, `void` one whose admission was not recorded.

Nothing here waits on anything remote: the views are local and the fleet's is the last scrape.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import orjson

from api.metrics import Metrics
from api.ports import Clock, Fleet, OutputPredictor, Replica, TokenEstimator
from api.services import refusal_errors
from api.services.auth import Caller
from api.services.chat_request import ChatRequest
from api.services.errors import ApiError
from api.services.recorder import Flight, Recorder
from api.services.routing_step import Routing, RoutingStep, request_task_class
from domain import admission
from domain.admission import AdmissionPolicy
from domain.admission_steps import (
    capacity_detail,
    fallback_models,
    kv_tokens,
    may_fall_back,
    resolve_run,
)
from domain.capacity import Choice, Refusal, UnknownModel
from domain.control_plane.state import ControlView
from domain.cost import Estimate, amount_micros, base_model, tpot_estimate_us
from domain.feedback import ImplicitSignals
from domain.governance.decide import StartRun
from domain.governance.decide import decide as hierarchy_decide
from domain.prediction import SYSTEM_PROMPT_BUCKETS, Prediction, RequestShape
from domain.requests.decide import (
    AdmitRequest,
    AskToPreempt,
    Command,
    CompleteRequest,
    PreemptRequest,
    RouteRequest,
)
from domain.routing import AUTO, QualityView
from domain.runs.events import RunBudgetExhausted
from domain.runs.state import Run, run_stream
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
        self.predictor = predictor
        self.tpot_target_us = tpot_target_us
        # The router's step; `quality` is the tenants' feedback folded (ledger/quality.py keeps
        # it current), `signals` what this edge remembers for the implicit feedback.
        self.router = RoutingStep(
            control=control, quality=quality or QualityView(), tokens=tokens,
            resolve=self.resolve_model, reject=reject, fact=recorder.fact, metrics=metrics,
            rng=rng, clock=clock, signals=signals,
        )  # fmt: skip

    # --- the models on sale --------------------------------------------------------------------

    def models(self) -> list[str]:
        """Model versions on sale: served by the fleet and priced now. An unpriced model could
        never be billed, so it is not offered (and the billing fold never meets one)."""
        now = self.clock()
        return [m for m in self.fleet.models() if self.control.has_price(m, now)]

    def resolve_model(self, requested: str) -> str | None:
        """A pinned version is served as is (if on sale); a base name goes to its newest
        version on sale; `auto` is the router's, decided with the caller's consent in `admit`."""
        if requested == AUTO:
            return AUTO
        if requested in self.fleet.serves:  # a version: no need to list every model on sale
            return requested if self.control.has_price(requested, self.clock()) else None
        versions = [m for m in self.models() if base_model(m) == requested]
        return max(versions) if versions else None

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
        consent no other model is ever served."""
        bucket = system_prompt_bucket(caller, req)
        tree = self.control.hierarchy
        run = None if run_id is None else resolve_run(
            tree, self.views.paths, caller.tenant_id, caller.key_id, run_id, self.clock()
        )  # fmt: skip
        routing = self.router.route(caller, req, model, request_id, is_retry, bucket, run)
        if isinstance(routing, ApiError):
            return Refused(routing)
        if routing is not None:
            model = routing.routed.served_model
        decision, shape = self._reserve(
            caller, req, model, request_id, is_retry, bucket, run,
            counted=None if routing is None else routing.counted,
        )  # fmt: skip
        if trace is not None:
            trace.quota_decided(decision)
        headers.update(refusal_errors.rate_limit_headers(decision.rate_limits))
        if isinstance(decision, admission.Rejected):
            self.reject(
                request_id, caller, model, decision.reason, decision.retry_after_s,
                decision.detail, is_retry,
            )
            if decision.reason == "run_budget" and run is not None:
                self._run_exhausted(run, decision.dimension or "", request_id)
            return Refused(refusal_errors.refusal(decision, headers))
        choice = self._route(
            model, caller.tier, decision.estimate, req.service_tier, request_id, trace
        )
        if isinstance(choice, Choice):
            if routing is not None:
                self.router.label(headers, routing)
            return self._admitted(
                caller, req, request_id, idempotency_key, is_retry, bucket, run, decision,
                shape, choice, model, routing=routing,
            )  # fmt: skip
        if not may_fall_back(req.service_tier):
            return self._flex_refused(caller, model, request_id, is_retry, headers, choice)
        self.views.void(request_id)
        return self._no_room(
            caller, req, model, request_id, idempotency_key, is_retry, headers, bucket, run,
            trace, routing, capacity_detail(choice),
        )  # fmt: skip

    def _no_room(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str,
        idempotency_key: str | None, is_retry: bool, headers: dict[str, str], bucket: int,
        run: Run | None, trace: RequestTrace | None, routing: Routing | None, reason: str,
    ) -> Admitted | Refused:  # fmt: skip
        """No replica of `model` takes the request: a routed one sheds to its reference model
        (per policy); another goes to a model the tenant consented to (`tollgate fallbacks
        allow`), else it is the capacity refusal."""
        if routing is not None:
            return self._shed(
                caller, req, request_id, idempotency_key, is_retry, headers, bucket, run, trace,
                routing, reason,
            )  # fmt: skip
        fallback = self._fall_back(
            caller, req, model, request_id, is_retry, headers, bucket, run, trace
        )
        if fallback is None:
            retry_after = self.policy.backoff.retry_after_s(self.rng.random())
            self.reject(request_id, caller, model, "capacity", retry_after, reason, is_retry)
            return Refused(
                refusal_errors.no_capacity(model, caller.tier, reason, retry_after, headers)
            )
        served, decision, shape, choice = fallback
        return self._admitted(
            caller, req, request_id, idempotency_key, is_retry, bucket, run, decision, shape,
            choice, served, downgraded_from=model, reason=reason,
        )  # fmt: skip

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
    ) -> tuple[str, admission.Admitted, RequestShape | None, Choice[Replica]] | None:
        """The first consented model whose own quota admits the request and that a replica
        takes: (that model, its quota decision, the predictor's question, the replica).
        `alternatives`: those models instead of the consented fallbacks (the router's shedding:
        not a downgrade)."""
        downgrade = alternatives is None
        if alternatives is None:
            consented = (
                self.resolve_model(m) for m in self.control.fallbacks(caller.tenant_id, model)
            )
            alternatives = fallback_models(model, consented)
        for alternative in alternatives:
            self.views.withdraw(request_id)
            other, shape = self._reserve(
                caller, req, alternative, request_id, is_retry, bucket, run
            )
            if isinstance(other, admission.Rejected):
                continue  # its own quota is spent: the next consented model, or a 503
            choice = self._route(
                alternative, caller.tier, other.estimate, "default", request_id, trace
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
    ) -> Admitted:  # fmt: skip
        """The admitted request's flight; the flex work its replica gives up is preempted, and
        the run it starts is recorded."""
        flight = Flight(
            request_id, caller.tenant_id, served, caller.tier, Progress(), choice,
            idempotency_key=idempotency_key, shape=shape, service_tier=req.service_tier,
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
            self._start_run(run)
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
            ),
            RouteRequest(
                request_id=request_id, replica_id=choice.replica_id,
                occupancy_ppm=choice.occupancy_ppm,
            ),
        ))  # fmt: skip

    def _shed(
        self, caller: Caller, req: ChatRequest, request_id: str, idempotency_key: str | None,
        is_retry: bool, headers: dict[str, str], bucket: int, run: Run | None,
        trace: RequestTrace | None, routing: Routing, reason: str,
    ) -> Admitted | Refused:  # fmt: skip
        """The routed model had no room: the reference model serves it, through its own quota
        and capacity like any request, when the policy says so (`on_capacity` "asked"); else,
        or when it has no room either, the capacity refusal any request gets."""
        served, reference = routing.routed.served_model, routing.routed.reference_model
        if routing.policy.on_capacity == "asked" and served != reference:
            shed = self._fall_back(
                caller, req, served, request_id, is_retry, headers, bucket, run, trace,
                alternatives=[reference],
            )  # fmt: skip
            if shed is not None:
                model, decision, shape, replica = shed
                routing = self.router.shed(routing, caller.tenant_id)
                self.router.label(headers, routing)
                return self._admitted(
                    caller, req, request_id, idempotency_key, is_retry, bucket, run, decision,
                    shape, replica, model, routing=routing,
                )  # fmt: skip
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        self.reject(request_id, caller, served, "capacity", retry_after, reason, is_retry)
        refused = refusal_errors.no_capacity(served, caller.tier, reason, retry_after, headers)
        return Refused(refused)

    # --- quota ---------------------------------------------------------------------------------

    def _reserve(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        system_prompt_bucket: int, run: Run | None = None,
        counted: tuple[TokenEstimator, int] | None = None,
    ) -> tuple[_Decision, RequestShape | None]:
        """The quota decision for serving `req` with `model` (charged to the views if
        admitted), and what the output predictor was asked about it. `counted`: the prompt
        already counted (by the router), taken when `model`'s estimator is the one that did."""
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
                tpot_us=tpot_estimate_us(
                    measured.p95_us if measured else None,
                    measured.age_s if measured else None,
                    self.tpot_target_us,
                ),
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

    # --- runs ----------------------------------------------------------------------------------

    def _start_run(self, run: Run) -> None:
        """Record the RunStarted of a run its first call started (at version 0: if another
        edge started it first, that one stands and this append is refused, which is counted)."""
        (event,) = hierarchy_decide(
            self.control.hierarchy,
            StartRun(run.tenant_id, run.run_id, run.project_id, run.limits, True),
        )
        self.recorder.fact(run_stream(run.tenant_id, run.run_id), run.tenant_id,
                           event, 0, run.started_at)  # fmt: skip

    def _run_exhausted(self, run: Run, dimension: str, request_id: str) -> None:
        if self.views.paths.mark_exhausted(run.tenant_id, run.run_id, dimension):
            event = RunBudgetExhausted(run.tenant_id, run.run_id, dimension, request_id)
            self.recorder.fact(
                run_stream(run.tenant_id, run.run_id), run.tenant_id, event, None
            )
            self.router.run_exhausted(run)

    # --- capacity ------------------------------------------------------------------------------

    def _route(
        self, model: str, tier: str, estimate: Estimate, service_tier: str, request_id: str,
        trace: RequestTrace | None = None,
    ) -> _Routed:  # fmt: skip
        started = 0 if trace is None else trace.now()
        choice = self.fleet.choose(
            model, tier, kv_tokens(estimate), self.rng, service_tier=service_tier,
            request_id=request_id,
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

    # --- the end of an admission ---------------------------------------------------------------

    def void(self, flight: Flight) -> None:
        """Its admission was not recorded, so nothing was admitted: the quota and the router's
        reservation are given back."""
        self.views.void(flight.request_id)
        self.fleet.release(flight.choice)
        self.router.ended(flight.request_id, completed=False)

    def settle(self, flight: Flight, command: Command) -> None:
        """The request ended (`command`, its terminal): the predictor learns a completed
        request's length, the views get what it did not use back and the router its KV."""
        p = flight.progress
        if (
            flight.shape is not None
            and self.predictor is not None
            and isinstance(command, CompleteRequest)
        ):
            # Only a completed request's count is its natural length: a cancelled or failed
            # one stopped short, and would teach the history and the coverage to expect less.
            state = flight.state
            reserved = state.reserved_output_tokens if state.predictor_version else None
            self.predictor.observe(flight.shape, reserved, p.completion_tokens)
        # Preempted: our decision, so the tenant's quota gets all of the reservation back.
        preempted = isinstance(command, PreemptRequest)
        used = 0 if preempted else p.prompt_tokens + p.completion_tokens
        now = self.clock()
        self.views.refund(flight.request_id, used, now, lambda: self._bill(flight, now, preempted))
        self.fleet.release(flight.choice)
        self.router.ended(flight.request_id, completed=isinstance(command, CompleteRequest))

    def _bill(self, flight: Flight, now: datetime, preempted: bool) -> tuple[int, int]:
        """What the bill will say (amount, tool calls), for every level's true-up: the same
        engine counts at the price in force at admission for its service tier
        (`domain.requests`'s bill; a preempted request bills nothing), so the bill changes
        nothing."""
        p = flight.progress
        state = flight.state
        admitted_at = state.admitted_at or now
        price = self.control.price(flight.model, admitted_at, state.service_tier)
        amount = 0 if preempted else amount_micros(
            price, p.prompt_tokens, p.completion_tokens, min(p.cached_tokens, p.prompt_tokens)
        )  # fmt: skip
        return amount, p.tool_calls


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
