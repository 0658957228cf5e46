"""The router (issue 32 items 2-4): the cheapest allowed model whose lower confidence bound on
the tenant's own feedback meets the bar; bounded exploration; drift latched to the reference;
consent recorded through the control plane; and at the edge, `auto` admitted like any request,
labelled, and never routed without consent."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import replace
from datetime import datetime
from typing import Any

import orjson
import pytest

from tests import builders as b
from tests.fakes import FakeClock, FakeFleet, FakeIdempotency, FakeReplica, FakeSink, FixedTokens
from tests.unit.test_edge import CALLER
from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.edge import Edge, JsonOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.decide import AllowRouting, RevokeRouting, decide_control
from tollgate_llm.domain.control_plane.events import PriceSet, RoutingAllowed, RoutingRevoked
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.events import KeyAssigned, ProjectCreated
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.events import (
    FeedbackRecorded,
    RequestAdmitted,
    RequestModelRouted,
    RequestRejected,
)
from tollgate_llm.domain.routing import (
    DRIFT_MIN,
    MIN_EVIDENCE,
    QualityView,
    RoutingPolicy,
    choose,
    lower_bound_ppm,
    task_class,
)
from tollgate_llm.ledger.commands import CommandHandler

SMALL, LARGE = "llama-3.1-8b-2026-05", "llama-3.1-70b-2026-05"
CLS = task_class(-1, 10, False, "text", False)
_ids = itertools.count(1)


def policy(bar_ppm: int = 800_000, exploration_ppm: int = 0, **kw: Any) -> RoutingPolicy:
    base = RoutingPolicy(b.TENANT, "", (SMALL, LARGE), bar_ppm, exploration_ppm, "asked", b.at(-1))
    return replace(base, **kw)


def scores(view: QualityView, model: str, *values: float, cls: str = CLS,
           routed_from: str = "", at: datetime | None = None) -> None:  # fmt: skip
    for value in values:
        event = FeedbackRecorded(
            f"req-{next(_ids)}", b.TENANT, model, cls, round(value * 1e6), "client", "",
            routed_from,
        )  # fmt: skip
        view.apply(b.record(event, stream_id=event.request_id, seconds=0 if at is None else
                            (at - b.T0).total_seconds()))  # fmt: skip


# --- the decision ------------------------------------------------------------------------------


def test_the_lower_bound_needs_evidence_before_it_meets_a_bar() -> None:
    assert lower_bound_ppm(0, 0) == 0
    assert lower_bound_ppm(9, 10) < 800_000 < 900_000  # 0.9 on ten is not yet 0.8 for sure
    assert lower_bound_ppm(90, 100) > 800_000  # on a hundred it is
    assert lower_bound_ppm(70, 100) < 700_000


def test_without_evidence_auto_is_the_reference_model() -> None:
    routed = choose(policy(), [SMALL, LARGE], QualityView(), CLS, 0.5)
    assert (routed.served_model, routed.reason, routed.estimate_ppm) == (LARGE, "below_bar", 0)
    assert routed.alternatives == (f"{SMALL}=0/0", f"{LARGE}=0/0")


def test_the_cheapest_model_whose_lower_bound_meets_the_bar_serves() -> None:
    view = QualityView()
    scores(view, SMALL, *[0.95] * 60)
    routed = choose(policy(), [SMALL, LARGE], view, CLS, 0.99)
    assert routed.served_model == SMALL and routed.reason == "meets_bar"
    assert routed.estimate_ppm >= 800_000 and routed.bar_ppm == 800_000
    # ... and not when its scores say it falls short (a lower bound under the bar)
    worse = QualityView()
    scores(worse, SMALL, *[0.7] * 60)
    assert choose(policy(), [SMALL, LARGE], worse, CLS, 0.99).served_model == LARGE


def test_evidence_pools_at_the_class_s_shape_until_the_class_has_its_own() -> None:
    view = QualityView()
    sibling = task_class(5, 10, False, "text", False)  # same shape, another system prompt
    scores(view, SMALL, *[1.0] * 40, cls=sibling)
    assert choose(policy(), [SMALL, LARGE], view, CLS, 0.99).served_model == SMALL
    scores(view, SMALL, *[0.0] * int(MIN_EVIDENCE), cls=CLS)  # its own now: and it is bad
    assert choose(policy(), [SMALL, LARGE], view, CLS, 0.99).served_model == LARGE


def test_exploration_is_bounded_and_never_tries_a_model_ruled_out() -> None:
    view = QualityView()
    rng = random.Random(3)
    tried = [choose(policy(exploration_ppm=100_000), [SMALL, LARGE], view, CLS, rng.random())
             for _ in range(2_000)]  # fmt: skip
    share = sum(r.served_model == SMALL for r in tried) / len(tried)
    assert 0.08 < share < 0.12 and {r.reason for r in tried} == {"explore", "below_bar"}
    scores(view, SMALL, *[0.1] * 40)  # its upper bound is below the bar: not tried again
    assert choose(policy(exploration_ppm=200_000), [SMALL, LARGE], view, CLS, 0.0).served_model \
        == LARGE  # fmt: skip


def test_a_class_whose_routed_traffic_falls_below_the_bar_is_latched_until_consent_is_renewed(
) -> None:  # fmt: skip
    view = QualityView()
    scores(view, SMALL, *[0.95] * 200)  # history that meets the bar by far
    scores(view, SMALL, *[0.5] * DRIFT_MIN, routed_from=LARGE, at=b.at(10))
    routed = choose(policy(), [SMALL, LARGE], view, CLS, 0.99)
    assert (routed.served_model, routed.reason) == (LARGE, "latched")
    # Consent given again after the drift ("retrained"): the latch is forgotten.
    assert choose(policy(since=b.at(20)), [SMALL, LARGE], view, CLS, 0.99).served_model == SMALL


def test_feedback_folds_once_and_implicit_signals_weigh_half() -> None:
    view = QualityView()
    event = FeedbackRecorded("r", b.TENANT, SMALL, CLS, 0, "cancelled")
    recorded = b.record(event, stream_id="r")
    view.apply(recorded)
    view.apply(recorded)  # redelivered
    assert view.classes[(b.TENANT, SMALL, CLS)].weight == 0.5


def test_a_task_class_is_features_only() -> None:
    assert task_class(7, 300, True, "json_schema", True) == "p1.t1.fs.r1.b7"
    assert task_class(-1, 20_000, False, "weird", False) == "p4.t0.ft.r0.b-1"


# --- consent, through the control plane -----------------------------------------------------------


def control() -> ControlView:
    view = ControlView()
    view.apply(b.record(b.tenant_registered(), stream_id="tenant-acme"))
    return view


def test_consent_is_recorded_once_and_a_repeat_changes_nothing_unless_drift_is_reset() -> None:
    view = control()
    command = AllowRouting(b.TENANT, (SMALL, LARGE), 800_000)
    (event,) = decide_control(view, command)
    assert event == RoutingAllowed(b.TENANT, "", (SMALL, LARGE), 800_000, 50_000, "asked")
    view.apply(b.record(event, version=2, stream_id="tenant-acme", seconds=5))
    book = view.routing_book
    assert book.routing(b.TENANT) == policy(exploration_ppm=50_000, since=b.at(5))
    assert book.routing(b.TENANT, "some-project") == book.routing(b.TENANT)  # the org's
    assert decide_control(view, command) == ()
    assert decide_control(view, replace(command, reset_drift=True)) == (event,)
    assert decide_control(view, RevokeRouting(b.TENANT)) == (RoutingRevoked(b.TENANT, ""),)


@pytest.mark.parametrize(
    ("command", "field"),
    [
        (AllowRouting(b.TENANT, (SMALL,), 800_000), "models"),
        (AllowRouting(b.TENANT, (SMALL, "auto"), 800_000), "models"),
        (AllowRouting(b.TENANT, (SMALL, SMALL), 800_000), "models"),
        (AllowRouting(b.TENANT, (SMALL, LARGE), 0), "quality_bar"),
        (AllowRouting(b.TENANT, (SMALL, LARGE), 1_000_001), "quality_bar"),
        (AllowRouting(b.TENANT, (SMALL, LARGE), 800_000, 200_001), "exploration"),
        (AllowRouting(b.TENANT, (SMALL, LARGE), 800_000, on_capacity="maybe"), "on_capacity"),
        (AllowRouting(b.TENANT, (SMALL, LARGE), 800_000, project_id="nope"), "project"),
        (AllowRouting("nobody", (SMALL, LARGE), 800_000), "tenant_id"),
    ],
)
def test_a_malformed_consent_is_refused_naming_its_field(command: AllowRouting, field: str) -> None:
    with pytest.raises(DomainError) as err:
        decide_control(control(), command)
    assert err.value.field == field


# --- at the edge --------------------------------------------------------------------------------


class Router:
    """An edge over a small and a large model (the large one 10x the price), with feedback."""

    def __init__(self) -> None:
        self.control = control()
        cheap = b.price_set(model="llama-3.1-8b", effective_at=b.at(-60))
        dear = PriceSet("llama-3.1-70b", 2_000_000, 6_000_000, 500_000, b.at(-60))
        for i, event in enumerate((b.key_issued(), cheap, dear)):
            stream = f"prices-{i}" if isinstance(event, PriceSet) else "tenant-acme"
            self.control.apply(b.record(event, version=i + 2, seconds=-60, stream_id=stream))
        self.clock = FakeClock(b.at(0))
        self.fleet = FakeFleet(FakeReplica("r-small", SMALL), FakeReplica("r-large", LARGE))
        self.sink = FakeSink()
        self.quality = QualityView()
        metrics = Metrics()
        metrics.models.known = frozenset(self.fleet.models())
        self.edge = Edge(
            control=self.control, quota=QuotaView(self.control.limits), fleet=self.fleet,
            events=self.sink, idempotency=FakeIdempotency(), metrics=metrics,
            tokens=lambda model: FixedTokens(), edge_id="edge-1", rng=random.Random(7),
            clock=self.clock, commands=CommandHandler(self.sink.store, clock=self.clock),
            quality=self.quality,
        )  # fmt: skip
        self.n = 0

    def consent(self, **kw: Any) -> None:
        (event,) = decide_control(self.control, AllowRouting(b.TENANT, (SMALL, LARGE), 800_000,
                                                             0, **kw))  # fmt: skip
        self.control.apply(b.record(event, version=5, stream_id="tenant-acme", seconds=-30))

    def chat(self, model: str = "auto") -> JsonOutcome:
        self.n += 1
        raw = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})

        async def go() -> JsonOutcome:
            out = await self.edge.chat(CALLER, raw, request_id=f"req_{self.n:032x}",
                                       idempotency_key=None, retry_count=0)  # fmt: skip
            assert isinstance(out, JsonOutcome)
            return out

        return asyncio.run(go())

    def events(self) -> list[Any]:
        return [r.event for r in self.sink.store.read_stream(f"req_{self.n:032x}")]


def test_without_consent_auto_is_an_unknown_model_and_nothing_is_routed() -> None:
    router = Router()
    with pytest.raises(ApiError) as err:
        router.chat()
    assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
    assert [type(e) for e in router.events()] == [RequestRejected]
    # A model asked by name is served as asked, whatever the feedback says.
    scores(router.quality, SMALL, *[1.0] * 100)
    router.consent()
    out = router.chat(LARGE)
    assert "X-Tollgate-Routed-To" not in out.headers
    assert not any(isinstance(e, RequestModelRouted) for e in router.events())


def test_auto_goes_to_the_small_model_once_feedback_proves_it_and_says_so() -> None:
    router = Router()
    router.consent()
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == LARGE  # no evidence yet: the reference
    scores(router.quality, SMALL, *[0.95] * 80)
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == SMALL
    assert out.headers["X-Tollgate-Routing-Reason"] == "meets_bar"
    admitted = next(e for e in router.events() if isinstance(e, RequestAdmitted))
    assert admitted.model == SMALL  # served, and so billed, as the small model
    routed = next(e for e in router.events() if isinstance(e, RequestModelRouted))
    assert (routed.asked_model, routed.reference_model, routed.served_model) == (
        "auto", LARGE, SMALL)  # fmt: skip
    assert routed.estimate_ppm >= routed.bar_ppm == 800_000
    assert routed.task_class == CLS and len(routed.alternatives) == 2


def test_a_full_small_fleet_sheds_to_the_reference_model_or_refuses_per_policy() -> None:
    router = Router()
    router.consent()
    scores(router.quality, SMALL, *[0.95] * 80)
    router.fleet.full_models = {SMALL}
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == LARGE
    assert out.headers["X-Tollgate-Routing-Reason"] == "shed_capacity"
    routed = next(e for e in router.events() if isinstance(e, RequestModelRouted))
    assert routed.served_model == LARGE and routed.reason == "shed_capacity"

    router.consent(on_capacity="refuse")
    with pytest.raises(ApiError) as err:
        router.chat()
    assert err.value.status == 503
    rejected = router.events()
    assert [type(e) for e in rejected] == [RequestRejected] and rejected[0].reason == "capacity"


def test_a_routed_request_goes_through_quota_like_any_other() -> None:
    router = Router()
    router.control.apply(b.record(b.limits_set(rpm=1), version=9, stream_id="tenant-acme",
                                  seconds=-20))  # fmt: skip
    router.consent()
    router.chat()
    with pytest.raises(ApiError) as err:
        router.chat()
    assert err.value.status == 429


def test_a_key_is_routed_under_the_consent_in_force_for_it_as_the_control_plane_changes() -> None:
    # The edge keeps which consent each key has between requests: each change of the control
    # plane (a project's own consent, the key moved into it, a revoke) is seen at the next one.
    router = Router()
    router.consent()
    scores(router.quality, SMALL, *[0.95] * 80)
    assert router.chat().headers["X-Tollgate-Routed-To"] == SMALL

    def fold(*events: Any) -> None:
        for event in events:
            router.control.apply(b.record(event, version=6, stream_id="tenant-acme", seconds=-10))

    fold(ProjectCreated(b.TENANT, "p1", "p1", "ws"))
    (own,) = decide_control(
        router.control, AllowRouting(b.TENANT, (SMALL, LARGE), 990_000, 0, project_id="p1")
    )
    fold(own)
    assert router.chat().headers["X-Tollgate-Routed-To"] == SMALL  # the key is not in p1 yet
    fold(KeyAssigned(b.TENANT, CALLER.key_id, "p1"))
    out = router.chat()  # p1's bar, 0.99, is above what the small model has shown
    assert (out.headers["X-Tollgate-Routed-To"], out.headers["X-Tollgate-Routing-Reason"]) == (
        LARGE, "below_bar")  # fmt: skip
    fold(RoutingRevoked(b.TENANT, "p1"))
    assert router.chat().headers["X-Tollgate-Routed-To"] == SMALL  # the organization's again
    fold(RoutingRevoked(b.TENANT, ""))
    with pytest.raises(ApiError) as err:
        router.chat()
    assert err.value.code == "model_not_found"
