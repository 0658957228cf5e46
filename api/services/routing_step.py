"""The router's step of admission (`domain.routing`): which model serves a request that asked for
`auto` (or named the policy's most expensive model, when the policy says so), with the tenant's
consent; what the answer says of it and what is recorded; and the implicit feedback an edge sees
without content (`domain.feedback.ImplicitSignals`), for the tenants that consented.

Admission (api/services/admission.py) calls it before quota and capacity, which the chosen model
then goes through like any request. Nothing here waits on anything remote.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Final

import orjson

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import Clock, TokenEstimator
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Price
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.feedback import Asked, ImplicitSignals
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted
from tollgate_llm.domain.routing import AUTO, QualityView, Routed, RoutingPolicy, choose, task_class
from tollgate_llm.domain.runs.state import Run

__all__ = ["Routing", "RoutingStep", "request_task_class", "unit_price"]

# How a refusal is recorded (`Edge._reject`), as Admission has it.
Reject = Callable[[str, Caller, str, str, int, str, bool], None]
# How long the models on sale of a policy, in price order, are taken as known (`_ladder`).
LADDER_TTL = timedelta(seconds=1)
# How often the edge orders them again off the request path (`RoutingStep.refresh`).
REFRESH_S = LADDER_TTL.total_seconds() / 2
# How a fact of another stream is recorded without waiting (`Recorder.fact`): (stream id,
# tenant, event, expected version).
Fact = Callable[[str, str, Event, int | None], None]
# A ladder not ordered yet: taken as expired.
_NEVER = datetime.min.replace(tzinfo=UTC)


@dataclass(slots=True)
class _Ladder:
    """A consent's models on sale, cheapest first (`RoutingStep._order`), taken as known until
    `until`: one per (tenant, project) consent, ordered again in place; `_NO_CONSENT` for a
    key without one."""

    policy: RoutingPolicy | None
    until: datetime
    on_sale: list[str]


_NO_CONSENT: Final = _Ladder(None, _NEVER, [])


@dataclass(slots=True)
class Routing:
    """The router's answer for one request, and the consent it was given under. Not frozen:
    one is made per routed request, and a frozen dataclass's constructor costs three times as
    much (each field set through object.__setattr__); nothing changes one once made (`shed`
    makes another)."""

    routed: Routed
    policy: RoutingPolicy
    asked: str  # "auto", or the reference model the request named
    # The prompt as counted for the task class, and by which estimator: admission counts it
    # once (`QuotaStep.reserve` takes it when the served model's estimator is the same one).
    counted: tuple[TokenEstimator, int] | None = None

    def event(self, request_id: str) -> RequestModelRouted:
        r = self.routed
        return RequestModelRouted(
            request_id, self.asked, r.reference_model, r.served_model, r.task_class,
            r.estimate_ppm, r.bar_ppm, r.reason, r.alternatives,
        )  # fmt: skip


class RoutingStep:
    def __init__(
        self, *, control: ControlView, quality: QualityView,
        tokens: Callable[[str], TokenEstimator], resolve: Callable[[str], str | None],
        reject: Reject, fact: Fact, metrics: Metrics, rng: random.Random, clock: Clock,
        signals: ImplicitSignals | None = None,
    ) -> None:  # fmt: skip
        """`resolve`: a model name as admission resolves it (on sale, else None); `quality`:
        the tenants' feedback folded (ledger/quality.py keeps it current)."""
        self.control = control
        self.quality = quality
        self.tokens = tokens
        self.resolve = resolve
        self.reject = reject
        self.fact = fact
        self.metrics = metrics
        self.rng = rng
        self.clock = clock
        self.signals = signals or ImplicitSignals()
        # tenant -> project -> its consent's models on sale
        self._ladders: dict[str, dict[str, _Ladder]] = {}
        # (tenant, key) -> the ladder of the consent in force for the key, while the control
        # view's `changes` stays `_changes`: a request reads it in one look-up, where the key's
        # project and its consent are four calls (`policy`), each of them cold at admission,
        # whose cache misses were most of the step's tail.
        self._keys: dict[tuple[str, str], _Ladder] = {}
        self._changes = -1

    def policy(self, caller: Caller) -> RoutingPolicy | None:
        project = self.control.hierarchy.project_of_key(caller.tenant_id, caller.key_id)
        return self.control.routing_book.routing(caller.tenant_id, project)

    def route(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        bucket: int, run: Run | None,
    ) -> Routing | ApiError | None:  # fmt: skip
        """The router's answer for a request of `model`: None when it is served as asked (not
        `auto`, or the tenant's policy does not route its reference model); for `auto` without
        consent (or none of its models on sale), the error an unknown model gets, recorded:
        nothing is routed for a tenant that did not ask for it."""
        if self._changes != self.control.changes:
            self._forget()
        ladder = self._keys.get((caller.tenant_id, caller.key_id)) or self._consent(caller)
        policy = ladder.policy
        if model != AUTO and (policy is None or not policy.route_reference):
            return None
        on_sale = ladder.on_sale
        if policy is not None:
            now = self.clock()
            if not now < ladder.until:
                on_sale = self._order(ladder, now)
        if model != AUTO:
            if not on_sale or model != on_sale[-1]:
                return None
        elif policy is None or not on_sale:
            detail = "no routing consent" if policy is None else "no routed model on sale"
            self.reject(request_id, caller, AUTO, "invalid", 0, detail, is_retry)
            return ApiError(
                404, f"The model `{AUTO}` does not exist or you do not have access to it.",
                param="model", code="model_not_found",
            )  # fmt: skip
        assert policy is not None
        estimator = self.tokens(on_sale[-1])
        tokens = estimator.prompt_tokens(req.messages, req.upstream.get("tools"))
        cls = request_task_class(req, bucket, tokens, run)
        routed = choose(policy, on_sale, self.quality, cls, self.rng.random())
        return Routing(routed, policy, model, (estimator, tokens))

    def shed(self, routing: Routing, tenant_id: str) -> Routing:
        """The reference model serves what the routed one had no room for."""
        r = routing.routed
        estimate = self.quality.estimate(tenant_id, r.reference_model, r.task_class)[0]
        shed = replace(
            r, served_model=r.reference_model, reason="shed_capacity", estimate_ppm=estimate
        )
        return replace(routing, routed=shed)

    def label(self, headers: dict[str, str], routing: Routing) -> None:
        """A routed answer says where it went and why (its `model` field names the model too);
        counted by model asked, model served and reason."""
        r = routing.routed
        headers["X-Tollgate-Routed-To"] = r.served_model
        headers["X-Tollgate-Routing-Reason"] = r.reason
        self.metrics.routed_of(routing.asked, r.served_model, r.reason).inc()

    def _forget(self) -> None:
        """The control view changed: which consent each key has is looked up again. Its count
        is read before any consent is: a change folded meanwhile is seen at the next request."""
        self._changes = self.control.changes
        self._keys.clear()

    def _consent(self, caller: Caller) -> _Ladder:
        """The ladder of the consent in force for the caller's key (`_NO_CONSENT`: none), whose
        models on sale are taken as known for at most LADDER_TTL: resolving and pricing them
        was most of the step's cost, and they change when an operator acts. `refresh`, on a
        timer beside admission, keeps them current so that a request finds them ready; a
        request orders them itself only for a consent new to the step, or when no refresh
        came in time."""
        policy = self.policy(caller)
        ladder = _NO_CONSENT if policy is None else self._ladder_of(policy)
        self._keys[(caller.tenant_id, caller.key_id)] = ladder
        return ladder

    def _ladder_of(self, policy: RoutingPolicy) -> _Ladder:
        projects = self._ladders.get(policy.tenant_id)
        if projects is None:
            projects = self._ladders[policy.tenant_id] = {}
        kept = projects.get(policy.project_id)
        if kept is None or kept.policy is not policy:
            # Ordered at its first request: a consent's ladder is made for its keys only.
            on_sale = [] if kept is None else kept.on_sale
            kept = projects[policy.project_id] = _Ladder(policy, _NEVER, on_sale)
        return kept

    def _order(self, ladder: _Ladder, now: datetime) -> list[str]:
        policy = ladder.policy
        assert policy is not None
        on_sale = [m for m in dict.fromkeys(self.resolve(name) for name in policy.models) if m]
        on_sale.sort(key=lambda m: (unit_price(self.control.price(m, now)), m))
        if ladder.on_sale == on_sale:
            on_sale = ladder.on_sale  # the same order: the same list, which `choose` compares
        ladder.on_sale = on_sale
        ladder.until = now + LADDER_TTL
        return on_sale

    def refresh(self) -> None:
        """Order again the models of every policy a request has used (the policy in force for
        it now, a new price, a new model version on sale), off the request path: the edge's
        runtime calls this every REFRESH_S, so that admission reads a ready ladder."""
        now = self.clock()
        for tenant_id, projects in list(self._ladders.items()):
            for project_id, kept in list(projects.items()):
                policy = self.control.routing_book.routing(tenant_id, project_id or None)
                if policy is None or policy.project_id != project_id:
                    del projects[project_id]  # revoked, or the project's own one is gone
                elif kept.until > _NEVER:  # one no request has ordered yet waits for one
                    self._order(self._ladder_of(policy), now)

    # --- implicit feedback ---------------------------------------------------------------------

    def admitted(
        self, caller: Caller, req: ChatRequest, request_id: str, model: str, cls: str,
        routing: Routing | None, run: Run | None,
    ) -> None:  # fmt: skip
        """Remember an admitted request of a consenting tenant, and record the "reasked" signal
        on the one it asks again, if it does (domain.feedback.ImplicitSignals)."""
        if routing is None and self.policy(caller) is None:
            return
        now = self.clock()
        asked = Asked(
            request_id, caller.tenant_id, model, unit_price(self.control.price(model, now)), cls,
            routing.routed.reference_model if routing is not None
            and routing.routed.served_model != routing.routed.reference_model else "",
            (caller.tenant_id, caller.key_id, _messages_digest(caller.tenant_id, req)),
            None if run is None else (run.tenant_id, run.run_id),
            routed=routing is not None,
        )  # fmt: skip
        self._record(self.signals.admitted(asked, now))

    def ended(self, request_id: str, completed: bool) -> None:
        self.signals.ended(request_id, completed, self.clock())

    def run_exhausted(self, run: Run) -> None:
        self._record(self.signals.run_exhausted(run.tenant_id, run.run_id))

    def _record(self, signal: FeedbackRecorded | None) -> None:
        if signal is not None:
            # On the earlier request's stream, after its terminal, at whatever version it has.
            self.fact(signal.request_id, signal.tenant_id, signal, None)


def unit_price(price: Price) -> int:
    """What the router orders models by: a million prompt and a million completion tokens."""
    return price.prompt_micros_per_mtok + price.completion_micros_per_mtok


def request_task_class(req: ChatRequest, bucket: int, prompt_tokens: int, run: Run | None) -> str:
    """The request's task class (domain.routing): what the router's statistics are kept by."""
    fmt = req.upstream.get("response_format")
    return task_class(
        bucket, prompt_tokens, bool(req.upstream.get("tools")),
        fmt.get("type", "text") if isinstance(fmt, dict) else "text", run is not None,
    )  # fmt: skip


def _messages_digest(tenant_id: str, req: ChatRequest) -> bytes:
    """The messages as 16 bytes keyed by the tenant: equal for the same messages from the same
    tenant, nothing of the text, held in the edge's memory for the re-ask window only."""
    return hashlib.blake2b(
        orjson.dumps(req.messages), digest_size=16, key=tenant_id.encode()[:64]
    ).digest()
