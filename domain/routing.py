"""The one learned decision: which model serves a request that asked for `auto`, with the
tenant's consent (`RoutingPolicy`, `tollgate routing allow`). The cheapest allowed model whose
quality for the request's task class meets the bar by a lower confidence bound on the tenant's
own feedback (`QualityView`, folded from `FeedbackRecorded`); a bounded share explores; a class
whose routed model's recent answers score below the bar is latched to the reference model
(drift) until the policy is given again. Task classes are admission-time features only, never text.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.prediction import SYSTEM_PROMPT_BUCKETS
from tollgate_llm.domain.requests.events import FeedbackRecorded
from tollgate_llm.domain.router_model import RouterModel

__all__ = [
    "AUTO",
    "EXPLORATION_PPM_MAX",
    "QualityView",
    "Routed",
    "RoutingPolicy",
    "choose",
    "lower_bound_ppm",
    "task_class",
]

# The model name that asks the router (a model of that name could not be put on sale).
AUTO: Final = "auto"
# Prompt-length bands, in tokens: a class says "short chat" or "long document", not a length.
PROMPT_BANDS: Final = (256, 1_024, 4_096, 16_384)
RESPONSE_FORMATS: Final = {"text": "t", "json_object": "o", "json_schema": "s"}
# One-sided 95 % Wilson bound: the estimate a routed model must meet the bar by.
Z: Final = 1.645
# Less evidence than this at a level (the class, then its shape without the system-prompt
# bucket) says nothing: the model's bound there is 0 and it is not routed to, only explored.
MIN_EVIDENCE: Final = 10.0
# A signal seen without content (a client leaving a stream, asking again on a larger model, a run
# that ran out of budget: domain.feedback) is a weaker sign than a customer's own score (it may
# have had what it needed): it counts as half a score of 0.
IMPLICIT_WEIGHT: Final = 0.5
# Exploration is bounded: at most 20 % of a class's traffic may go where the bar is not yet met.
EXPLORATION_PPM_MAX: Final = 200_000
DEFAULT_EXPLORATION_PPM: Final = 50_000
# Drift: the last DRIFT_WINDOW routed feedbacks of a model on a class; once DRIFT_MIN of them are
# in and their mean is below the bar while the model's whole history still meets it, the class
# goes to the reference model until the policy is given again (`tollgate routing allow`), which
# is the router's "retrain".
DRIFT_WINDOW: Final = 50
DRIFT_MIN: Final = 20
ON_CAPACITY: Final = ("asked", "refuse")


def task_class(
    system_prompt_bucket: int, prompt_tokens: int, tools: bool, response_format: str,
    in_run: bool,
) -> str:  # fmt: skip
    """The request's task class, e.g. "p1.t0.ft.r0.b7": prompt band, tools present, response
    format, part of a run, the tenant-keyed system-prompt bucket (-1: none). All known at
    admission; nothing of the text. Read from `_CLASSES` (every class of a bucket in range,
    made once, in one flat table: a nested one costs a read of each level's list, each in
    memory of its own, which admission reads cold): admission formats no string for it."""
    band = bisect.bisect_right(PROMPT_BANDS, prompt_tokens)
    fmt = _FORMAT_INDEX.get(response_format, 0)
    if -1 <= system_prompt_bucket < SYSTEM_PROMPT_BUCKETS:
        bucket_band = (system_prompt_bucket + 1) * _BANDS + band
        return _CLASSES[((bucket_band * 2 + tools) * _FORMAT_COUNT + fmt) * 2 + in_run]
    return _format_class(system_prompt_bucket, band, tools, _FORMATS[fmt], in_run)


def _format_class(bucket: int, band: int, tools: bool, fmt: str, in_run: bool) -> str:
    return f"p{band}.t{int(tools)}.f{fmt}.r{int(in_run)}.b{bucket}"


_FORMATS: Final = tuple(RESPONSE_FORMATS.values())
_FORMAT_INDEX: Final = {name: i for i, name in enumerate(RESPONSE_FORMATS)}
_FORMAT_COUNT: Final = len(_FORMATS)
_BANDS: Final = len(PROMPT_BANDS) + 1
# (bucket + 1, band, tools, format, in run), in that order of significance -> the class
_CLASSES: Final = tuple(
    _format_class(b, band, tools, f, run)
    for b in range(-1, SYSTEM_PROMPT_BUCKETS)
    for band in range(_BANDS)
    for tools in (False, True)
    for f in _FORMATS
    for run in (False, True)
)


def shape_of(cls: str) -> str:
    """The class without its system-prompt bucket: the coarser level evidence is pooled at."""
    return cls.rsplit(".b", 1)[0]


def lower_bound_ppm(score_sum: float, weight: float, z: float = Z) -> int:
    """Wilson's lower bound of the mean score (scores in [0, 1], weighted), in ppm; 0 without
    evidence. Fractional scores are taken as fractional successes."""
    if weight <= 0:
        return 0
    p = min(1.0, max(0.0, score_sum / weight))
    z2 = z * z
    centre = p + z2 / (2 * weight)
    margin = z * math.sqrt(p * (1 - p) / weight + z2 / (4 * weight * weight))
    return max(0, int((centre - margin) / (1 + z2 / weight) * 1_000_000))


def upper_bound_ppm(score_sum: float, weight: float, z: float = Z) -> int:
    if weight <= 0:
        return 1_000_000
    return 1_000_000 - lower_bound_ppm(weight - score_sum, weight, z)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """A tenant's (or one project's) consent: `models` may serve its `auto` requests, the most
    expensive of them being the reference (what `auto` means without evidence)."""

    tenant_id: str
    project_id: str  # "" for the whole organization
    models: tuple[str, ...]
    quality_bar_ppm: int
    exploration_ppm: int
    on_capacity: str  # asked: shed to the reference model | refuse: 503
    since: datetime  # when this consent was recorded: drift latches before it are forgotten
    route_reference: bool = False  # a request naming the reference model is routed too


@dataclass(slots=True)
class _Tally:
    score_sum: float = 0.0
    weight: float = 0.0
    # Its bounds, computed once per change rather than at every admission that reads them.
    bounds: tuple[int, int] | None = None

    def add(self, score: float, weight: float) -> None:
        self.score_sum += score * weight
        self.weight += weight
        self.bounds = None

    def bounds_ppm(self) -> tuple[int, int]:
        if self.bounds is None:
            self.bounds = (
                lower_bound_ppm(self.score_sum, self.weight),
                upper_bound_ppm(self.score_sum, self.weight),
            )
        return self.bounds


@dataclass(slots=True)
class _Window:
    """A class's last DRIFT_WINDOW routed scores, with their sum kept as they come and go."""

    scores: deque[tuple[datetime, float]] = field(
        default_factory=lambda: deque(maxlen=DRIFT_WINDOW)
    )
    total: float = 0.0

    def append(self, at: datetime, score: float) -> None:
        if len(self.scores) == DRIFT_WINDOW:
            self.total -= self.scores[0][1]
        self.scores.append((at, score))
        self.total += score


@dataclass(slots=True)
class QualityView:
    """The tenant's feedback folded per (tenant, model, class) and per (tenant, model, shape),
    and each class's recent routed scores (drift). A redelivered event changes nothing.

    `use_model` adds a trained estimate (`domain.router_model`), read where its coverage guard
    holds. `plans` keeps, per tenant and class, what `choose` decided from all of it: a
    feedback decides again the classes of its shape as it is folded, a new trained model
    every class as it is loaded, a new policy or price order at the next request. So
    admission reads a decision; it makes one only for a class, policy or price order new to
    it."""

    classes: dict[tuple[str, str, str], _Tally] = field(default_factory=dict)
    shapes: dict[tuple[str, str, str], _Tally] = field(default_factory=dict)
    # (tenant, model, class) -> the scores of its routed answers, latest last
    recent: dict[tuple[str, str, str], _Window] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    position: int = 0
    # The trained model's lower bounds, (tenant, model, class) -> ppm, where its guard holds.
    learned: dict[tuple[str, str, str], int] = field(default_factory=dict)
    model_version: str = ""
    # tenant -> class -> the decision made for it (`choose`)
    plans: dict[str, dict[str, _Plan]] = field(default_factory=dict)

    def apply(self, recorded: Recorded) -> None:
        event = recorded.event
        if not isinstance(event, FeedbackRecorded) or recorded.event_id in self.seen:
            return
        self.seen.add(recorded.event_id)
        self.position = max(self.position, recorded.position)
        if not event.task_class:
            return
        score = event.score_ppm / 1_000_000
        weight = 1.0 if event.source == "client" else IMPLICIT_WEIGHT
        tenant, model, cls = event.tenant_id, event.model, event.task_class
        shape = shape_of(cls)
        self.classes.setdefault((tenant, model, cls), _Tally()).add(score, weight)
        self.shapes.setdefault((tenant, model, shape), _Tally()).add(score, weight)
        if event.routed_from and event.source == "client":
            window = self.recent.get((tenant, model, cls))
            if window is None:
                window = self.recent[(tenant, model, cls)] = _Window()
            window.append(recorded.occurred_at, score)
        plans = self.plans.get(tenant)
        if plans:  # decided again here, for the classes whose estimates this may have moved
            # (a copy of the keys: the edge folds feedback on another thread than admission's,
            # which may add a class meanwhile, decided on the tallies as it read them)
            for stale in [c for c in list(plans) if c == cls or shape_of(c) == shape]:
                plan = plans.get(stale)
                if plan is not None:
                    plans[stale] = _decide(plan.policy, plan.on_sale, self, stale)

    def use_model(self, model: RouterModel | None) -> None:
        """Read `model`'s estimates from now on where its guard holds (None: Wilson only)."""
        self.learned = {} if model is None else model.table()
        self.model_version = "" if model is None else model.version
        # Every class decided again now, as the model is loaded, rather than by the next
        # request of each (a fresh dict: admission's thread may be reading the old one).
        self.plans = {
            tenant: {cls: _decide(p.policy, p.on_sale, self, cls) for cls, p in list(plans.items())}
            for tenant, plans in list(self.plans.items())
        }

    def estimate(self, tenant_id: str, model: str, cls: str) -> tuple[int, int, float]:
        """(lower bound ppm, upper bound ppm, evidence) of `model` for `cls`: the trained
        model's lower bound where it covers the class, else Wilson's at the class when it has
        MIN_EVIDENCE, else at its shape, else none (0, 1e6, what there is). The upper bound
        is always Wilson's (exploration rules a model out by it)."""
        learned = self.learned.get((tenant_id, model, cls)) if self.learned else None
        for level, key in ((self.classes, cls), (self.shapes, shape_of(cls))):
            tally = level.get((tenant_id, model, key))
            if tally is not None and tally.weight >= MIN_EVIDENCE:
                low, high = tally.bounds_ppm()
                return (low if learned is None else learned), high, tally.weight
        tally = self.classes.get((tenant_id, model, cls))
        weight = 0.0 if tally is None else tally.weight
        return (0 if learned is None else learned), 1_000_000, weight

    def drifted(self, tenant_id: str, model: str, cls: str, bar_ppm: int, since: datetime) -> bool:
        """`model`'s routed answers of the class since `since` score below the bar (DRIFT_MIN
        of them at least): what its estimate, all of its history, does not show yet."""
        window = self.recent.get((tenant_id, model, cls))
        if window is None or len(window.scores) < DRIFT_MIN:
            return False
        if window.scores[0][0] >= since:  # all since the consent: the sum kept
            return window.total / len(window.scores) * 1_000_000 < bar_ppm
        # A copy first (one C call): the edge folds feedback, which appends here, on another
        # thread than admission's, and a deque mutated while iterated raises.
        scores = [score for at, score in tuple(window.scores) if at >= since]
        return len(scores) >= DRIFT_MIN and sum(scores) / len(scores) * 1_000_000 < bar_ppm


@dataclass(frozen=True, slots=True)
class Routed:
    """The router's answer: the model to serve and why (what RequestModelRouted records)."""

    served_model: str
    reference_model: str
    task_class: str
    estimate_ppm: int
    bar_ppm: int
    reason: str  # meets_bar | explore | below_bar | latched
    alternatives: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Plan:
    """What `choose` answers for a class under a policy and a price order, until a feedback of
    the class's shape (or a new model) moves its estimates: the model that meets the bar (or
    the reference, latched), else the one exploration may try, and the reference."""

    policy: RoutingPolicy
    on_sale: list[str]
    meets: Routed | None
    explore: Routed | None
    reference: Routed


def choose(
    policy: RoutingPolicy, cheapest_first: list[str], quality: QualityView, cls: str,
    draw: float,
) -> Routed:  # fmt: skip
    """The model for a request of class `cls`: the cheapest of `cheapest_first` (the policy's
    models on sale, by price) whose lower bound meets the bar; with probability
    `exploration_ppm` (`draw` uniform in [0, 1)) the cheapest not ruled out by its upper bound;
    else the reference (the most expensive). When the model that meets the bar has drifted (its
    recent routed answers score under the bar), the class is latched to the reference; a drifted
    model is not explored either. Only a model the router relies on can latch a class: the low
    scores of a model tried by exploration rule it out by its upper bound, not by drift.

    Decided once per class and kept (`QualityView.plans`): a request of a known class reads its
    answer and the draw, and allocates nothing."""
    plans = quality.plans.get(policy.tenant_id)
    plan = None if plans is None else plans.get(cls)
    if plan is None or plan.policy is not policy or plan.on_sale != cheapest_first:
        plan = _decide(policy, cheapest_first, quality, cls)
        if plans is None:
            plans = quality.plans[policy.tenant_id] = {}
        plans[cls] = plan
    if plan.meets is not None:
        return plan.meets
    if plan.explore is not None and draw * 1_000_000 < policy.exploration_ppm:
        return plan.explore
    return plan.reference


def _decide(
    policy: RoutingPolicy, cheapest_first: list[str], quality: QualityView, cls: str
) -> _Plan:
    reference = cheapest_first[-1]
    tenant, bar = policy.tenant_id, policy.quality_bar_ppm
    estimates = {m: quality.estimate(tenant, m, cls) for m in cheapest_first}
    learned = quality.learned
    alternatives = tuple(
        f"{m}={low}/{round(n)}{'/model' if (tenant, m, cls) in learned else ''}"
        for m, (low, _, n) in estimates.items()
    )

    def answer(model: str, reason: str) -> Routed:
        return Routed(model, reference, cls, estimates[model][0], bar, reason, alternatives)

    since = policy.since
    meets = explore = None
    for model in cheapest_first[:-1]:
        if estimates[model][0] >= bar:
            drifted = quality.drifted(tenant, model, cls, bar, since)
            meets = answer(reference, "latched") if drifted else answer(model, "meets_bar")
            break
    if meets is None:
        for model in cheapest_first[:-1]:
            if estimates[model][1] >= bar and not quality.drifted(tenant, model, cls, bar, since):
                explore = answer(model, "explore")
                break
    return _Plan(policy, list(cheapest_first), meets, explore, answer(reference, "below_bar"))
