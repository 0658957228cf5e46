"""The fallback step of admission: what happens when no replica of the model takes a request.
A routed request sheds to its policy's reference model (`on_capacity` "asked"); another goes to
a model its tenant consented to (`tollgate fallbacks allow`), under that model's own quota;
flex takes idle capacity or nothing. Else it is the capacity refusal (`region_unavailable` for
a tenant pinned to regions). Without consent no other model is ever served.

Admission (api/services/admission.py) calls it after the capacity step refused; what to try is
decided in `domain.admission_steps` (`may_fall_back`, `fallback_models`). Nothing here waits on
anything remote.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import Replica
from tollgate_llm.api.services import refusal_errors
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.quota_step import QuotaStep
from tollgate_llm.api.services.routing_step import Routing, RoutingStep
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import AdmissionPolicy
from tollgate_llm.domain.admission_steps import capacity_detail, fallback_models, may_fall_back
from tollgate_llm.domain.capacity import Choice, Refusal, UnknownModel
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.prediction import RequestShape
from tollgate_llm.domain.residency import refusal_detail
from tollgate_llm.domain.runs.state import Run
from tollgate_llm.domain.views import AdmissionViews

if TYPE_CHECKING:
    from tollgate_llm.api.services.tracing import RequestTrace

__all__ = ["Fallback", "FallbackStep"]

# How a refusal is recorded (`Edge._reject`), as Admission has it.
Reject = Callable[[str, Caller, str, str, int, str, bool], None]
# The capacity step (`Admission._route`): (model, tier, estimate, service tier, request id,
# trace, regions) -> the fleet's answer.
Route = Callable[
    [str, str, Estimate, str, str, "RequestTrace | None", "frozenset[str] | None"],
    "Choice[Replica] | Refusal | UnknownModel",
]


@dataclass(frozen=True, slots=True)
class Fallback:
    """Another model serves the request: `served`, its quota decision, what the output predictor
    was asked, its replica; `downgraded_from` and `reason` for a consented fallback, `routing`
    (shed to the reference model) for a routed request."""

    served: str
    decision: admission.Admitted
    shape: RequestShape | None
    choice: Choice[Replica]
    downgraded_from: str | None = None
    reason: str = ""
    routing: Routing | None = None


class FallbackStep:
    """Built by `Admission` from what it is given, so the edge's wiring stays as it is."""

    def __init__(
        self, *, control: ControlView, views: AdmissionViews, quota: QuotaStep, route: Route,
        router: RoutingStep, resolve: Callable[[str], str | None], reject: Reject,
        metrics: Metrics, rng: random.Random, policy: AdmissionPolicy,
    ) -> None:  # fmt: skip
        """`resolve`: a model name as admission resolves it (on sale, else None)."""
        self.control = control
        self.views = views
        self.quota = quota
        self.route = route
        self.router = router
        self.resolve = resolve
        self.reject = reject
        self.metrics = metrics
        self.rng = rng
        self.policy = policy

    def no_room(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], bucket: int, run: Run | None, trace: RequestTrace | None,
        routing: Routing | None, refused: Refusal | UnknownModel,
        regions: frozenset[str] | None, asked: str,
    ) -> Fallback | ApiError:  # fmt: skip
        """No replica of `model` takes the request (its quota already charged): a flex one is
        refused; a routed one sheds to its reference model (per policy); another goes to a
        model the tenant consented to from `asked` (an adapter's name: its base model without
        the adapter is another model), else it is the capacity refusal (`region_unavailable`
        for a pinned tenant)."""
        if not may_fall_back(req.service_tier):
            if regions is None:
                return self._flex_refused(caller, model, request_id, is_retry, headers, refused)
            # A pinned tenant's flex refusal says, like its other ones, that its regions had
            # no room: what it must know is that nothing ran elsewhere.
            self.metrics.flex_of(model, caller.tier, "refused").inc()
        self.views.void(request_id)
        reason = capacity_detail(refused)
        if routing is not None:
            return self._shed(
                caller, req, request_id, is_retry, headers, bucket, run, trace, routing, reason,
                regions,
            )  # fmt: skip
        fallback = None if not may_fall_back(req.service_tier) else self.fall_back(
            caller, req, asked, request_id, is_retry, headers, bucket, run, trace, regions=regions
        )  # fmt: skip
        if fallback is None:
            return self._no_capacity(caller, model, request_id, is_retry, headers, reason, regions)
        return replace(fallback, downgraded_from=asked, reason=reason)

    def fall_back(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], bucket: int, run: Run | None, trace: RequestTrace | None,
        alternatives: list[str] | None = None,
        regions: frozenset[str] | None = None,
    ) -> Fallback | None:
        """The first consented model whose own quota admits the request and that a replica
        takes. `alternatives`: those models instead of the consented fallbacks (the router's
        shedding: not a downgrade)."""
        downgrade = alternatives is None
        if alternatives is None:
            given = self.control.fallback_book.fallbacks(caller.tenant_id, model)
            alternatives = fallback_models(model, (self.resolve(m) for m in given))
        for alternative in alternatives:
            self.views.withdraw(request_id)
            other, shape = self.quota.reserve(
                caller, req, alternative, request_id, is_retry, bucket, run
            )
            if isinstance(other, admission.Rejected):
                continue  # its own quota is spent: the next consented model, or a 503
            choice = self.route(
                alternative, caller.tier, other.estimate, "default", request_id, trace, regions
            )
            if isinstance(choice, Choice):
                headers.update(refusal_errors.rate_limit_headers(other.rate_limits))
                if downgrade:
                    headers["X-Tollgate-Downgraded-From"] = model
                    self.metrics.downgraded.labels(model, alternative).inc()
                return Fallback(alternative, other, shape, choice)
            self.views.void(request_id)
        return None

    def _shed(
        self, caller: Caller, req: ChatRequest, request_id: str, is_retry: bool,
        headers: dict[str, str], bucket: int, run: Run | None, trace: RequestTrace | None,
        routing: Routing, reason: str, regions: frozenset[str] | None,
    ) -> Fallback | ApiError:  # fmt: skip
        """The routed model had no room: the reference model serves it, through its own quota
        and capacity like any request (in the tenant's regions), when the policy says so
        (`on_capacity` "asked"); else, or when it has no room either, the capacity refusal any
        request gets."""
        served, reference = routing.routed.served_model, routing.routed.reference_model
        if routing.policy.on_capacity == "asked" and served != reference:
            shed = self.fall_back(
                caller, req, served, request_id, is_retry, headers, bucket, run, trace,
                alternatives=[reference], regions=regions,
            )  # fmt: skip
            if shed is not None:
                routing = self.router.shed(routing, caller.tenant_id)
                self.router.label(headers, routing)
                return replace(shed, routing=routing)
        return self._no_capacity(caller, served, request_id, is_retry, headers, reason, regions)

    def _no_capacity(
        self, caller: Caller, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], reason: str, regions: frozenset[str] | None,
    ) -> ApiError:  # fmt: skip
        """The capacity refusal, recorded: `region_unavailable` for a pinned tenant."""
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        detail = refusal_detail(reason, regions)
        self.reject(request_id, caller, model, "capacity", retry_after, detail, is_retry)
        if regions is not None:
            return refusal_errors.region_unavailable(model, regions, retry_after, headers)
        return refusal_errors.no_capacity(model, caller.tier, reason, retry_after, headers)

    def _flex_refused(
        self, caller: Caller, model: str, request_id: str, is_retry: bool,
        headers: dict[str, str], refused: Refusal | UnknownModel,
    ) -> ApiError:  # fmt: skip
        """Flex takes idle capacity or nothing: no other model, and the refusal is OpenAI's
        flex 429 (not billed), recorded as a capacity refusal like any other."""
        self.views.void(request_id)
        reason = capacity_detail(refused)
        retry_after = self.policy.backoff.retry_after_s(self.rng.random())
        self.metrics.flex_of(model, caller.tier, "refused").inc()
        self.reject(request_id, caller, model, "capacity", retry_after, reason, is_retry)
        return refusal_errors.flex_unavailable(model, reason, retry_after, headers)
