"""The steps of an admission beside the quota decision (domain/admission_steps.py) and the one
facade over the edge's views (domain/views.py), as specifications: given, when, then."""

from __future__ import annotations

from tests import builders as b
from tollgate_llm.domain.admission import DEFAULT_POLICY, Admitted, ReserveQuota
from tollgate_llm.domain.admission_steps import (
    capacity_detail,
    fallback_models,
    kv_tokens,
    may_fall_back,
    resolve_run,
)
from tollgate_llm.domain.capacity import Refusal, UnknownModel
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.state import Hierarchy
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.remote_flex import RemoteFlex
from tollgate_llm.domain.runs.state import Run, RunLimits
from tollgate_llm.domain.views import AdmissionViews


def test_a_call_outside_a_run_belongs_to_none() -> None:
    assert resolve_run(Hierarchy(), PathView(), b.TENANT, b.KEY, None, b.at(0)) is None


def test_a_run_nobody_started_starts_with_its_first_call_implicitly() -> None:
    run = resolve_run(Hierarchy(), PathView(), b.TENANT, b.KEY, "task-1", b.at(5))
    assert run == Run(b.TENANT, "task-1", None, RunLimits(), b.at(5), implicit=True)


def test_a_run_this_edge_started_is_the_one_its_next_call_joins() -> None:
    paths = PathView()
    started = Run(b.TENANT, "task-1", None, RunLimits(), b.at(0), implicit=True)
    paths.runs.note(started)
    # It started at its first call (not this one), under the run policy in force then.
    assert resolve_run(Hierarchy(), paths, b.TENANT, b.KEY, "task-1", b.at(9)) == started
    # Another tenant's run of the same name is not this one.
    other = resolve_run(Hierarchy(), paths, "globex", b.KEY, "task-1", b.at(9))
    assert other is not None and other.started_at == b.at(9)


def test_a_capacity_refusal_says_why() -> None:
    assert capacity_detail(UnknownModel(b.MODEL)) == "no replica serves it"
    assert capacity_detail(Refusal(b.MODEL, "over_ceiling", 850_000, 990_000)) == "over_ceiling"


def test_flex_never_falls_back_to_another_model() -> None:
    assert not may_fall_back("flex")
    assert may_fall_back("default")


def test_the_fallbacks_are_the_consented_models_on_sale_but_the_one_refused_in_order() -> None:
    consented = ["m-b", None, b.MODEL, "m-a"]  # None: a consented model not on sale
    assert fallback_models(b.MODEL, consented) == ["m-b", "m-a"]


def test_the_router_holds_the_prompt_and_the_reserved_output() -> None:
    assert kv_tokens(b.estimate(prompt_tokens=10, reserved_output_tokens=5)) == 15


def _views() -> AdmissionViews:
    limits = b.limits(rpm=2)
    return AdmissionViews(QuotaView(lambda tenant, model: limits), PathView(), RemoteFlex("e1"))


def _reserve(request_id: str, seconds: float = 0) -> ReserveQuota:
    return ReserveQuota(
        request_id=request_id, tenant_id=b.TENANT, key_id=b.KEY, model=b.MODEL,
        tier="standard", edge_id="e1", prompt_tokens=10, max_tokens=5, min_tokens=None,
        kv_bytes_per_token=1, tpot_us=1000, now=b.at(seconds), jitter=0.0,
    )  # fmt: skip


def test_an_admission_charged_then_voided_gives_its_request_back() -> None:
    views = _views()
    limits = b.limits(rpm=2)
    assert isinstance(views.charge(_reserve("r1"), limits, None, b.price, DEFAULT_POLICY), Admitted)
    assert isinstance(views.charge(_reserve("r2"), limits, None, b.price, DEFAULT_POLICY), Admitted)
    assert not isinstance(
        views.charge(_reserve("r3"), limits, None, b.price, DEFAULT_POLICY), Admitted
    )  # the minute's two requests are taken
    views.void("r2")
    assert isinstance(views.charge(_reserve("r4"), limits, None, b.price, DEFAULT_POLICY), Admitted)


def test_a_refund_outside_the_hierarchy_never_works_out_a_bill() -> None:
    views = _views()
    views.charge(_reserve("r1"), b.limits(rpm=2), None, b.price, DEFAULT_POLICY)

    def bill() -> tuple[int, int]:
        raise AssertionError("only a request the hierarchy holds is trued up")

    views.refund("r1", 12, b.at(1), bill)
    assert views.quota.kv_in_flight(b.TENANT, b.MODEL) == 0


def test_the_facade_folds_what_each_view_folds() -> None:
    views = _views()
    assert views.folded_types() == (
        views.quota.folded_types() | views.paths.folded_types()
        | views.others_flex.folded_types()
    )
