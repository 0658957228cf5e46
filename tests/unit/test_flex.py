"""The flex class in the pure model: placement under the flex ceiling, the preemption plan, the
RequestPreempted terminal (refunded in full, billed nothing) and the flex price-book entry."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests import builders as b
from tests.builders import given
from tollgate_llm.domain.billing import bill_terminal
from tollgate_llm.domain.capacity import (
    FLEX_CEILING_PPM,
    TIER_CEILINGS_PPM,
    CapacityRefusal,
    FlexPolicy,
    Placement,
    Preemption,
    ReplicaLoad,
    place_flex,
    preemption_plan,
)
from tollgate_llm.domain.control_plane.decide import SetFlexDiscount, decide_control
from tollgate_llm.domain.control_plane.events import FlexDiscountSet
from tollgate_llm.domain.control_plane.prices import DEFAULT_FLEX_DISCOUNT_PPM
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import PreemptRequest
from tollgate_llm.domain.requests.events import QuotaRefunded, RequestPreempted

FLEX_ADMITTED = (b.admitted(service_tier="flex"), b.estimated())
FLEX_ROUTED = (*FLEX_ADMITTED, b.routed())


def first(items, n):  # type: ignore[no-untyped-def]
    return list(items)[:n]


# --- placement ----------------------------------------------------------------------------------


def test_the_flex_ceiling_is_below_every_tiers_ceiling() -> None:
    assert min(TIER_CEILINGS_PPM.values()) > FLEX_CEILING_PPM
    with pytest.raises(ValueError):
        FlexPolicy(ceiling_ppm=min(TIER_CEILINGS_PPM.values()))
    with pytest.raises(ValueError):
        FlexPolicy(ceiling_ppm=0)


def test_flex_is_placed_only_below_the_flex_ceiling() -> None:
    idle = ReplicaLoad("a", 100_000)
    busy = ReplicaLoad("b", FLEX_CEILING_PPM)  # free would still be admitted here (< 0.60)
    assert place_flex([idle], first) == Placement("a", 100_000)
    refused = place_flex([busy], first)
    assert isinstance(refused, CapacityRefusal) and refused.detail == "over_ceiling"
    assert refused.ceiling_ppm == FLEX_CEILING_PPM
    assert place_flex([ReplicaLoad("c", 300_000)], first, FlexPolicy(ceiling_ppm=200_000)) \
        == CapacityRefusal("over_ceiling", 200_000, 300_000)


def test_flex_may_backfill_reserved_replicas_unless_told_not_to() -> None:
    reserved = ReplicaLoad("r", 10_000, reserved_only=True)
    assert place_flex([reserved], first) == Placement("r", 10_000)
    refused = place_flex([reserved], first, FlexPolicy(backfill_reserved=False))
    assert isinstance(refused, CapacityRefusal) and refused.detail == "reserved_only"


def test_flex_is_judged_on_the_p2c_winner_alone() -> None:
    loads = [ReplicaLoad("a", 700_000), ReplicaLoad("b", 800_000), ReplicaLoad("c", 0)]
    assert isinstance(place_flex(loads, first), CapacityRefusal)  # drew a and b, c was idle


# --- preemption ---------------------------------------------------------------------------------


def test_preemption_frees_the_fewest_newest_flex_requests_that_make_room() -> None:
    # standard's ceiling is 0.85: 0.95 - 0.06 (newest) - 0.05 = 0.84
    load = ReplicaLoad("a", 950_000, flex=(("old", 500_000), ("mid", 50_000), ("new", 60_000)))
    assert preemption_plan("standard", [load]) == Preemption("a", ("new", "mid"), 840_000)


def test_preemption_picks_the_replica_needing_fewest_aborts() -> None:
    a = ReplicaLoad("a", 900_000, flex=(("a1", 30_000), ("a2", 30_000)))
    b_ = ReplicaLoad("b", 900_000, flex=(("b1", 100_000),))
    assert preemption_plan("standard", [a, b_]) == Preemption("b", ("b1",), 800_000)


def test_no_preemption_where_even_all_flex_work_would_not_make_room() -> None:
    load = ReplicaLoad("a", 990_000, flex=(("x", 50_000),))
    assert preemption_plan("standard", [load]) is None
    assert preemption_plan("standard", [ReplicaLoad("b", 990_000)]) is None


def test_preemption_never_opens_a_reserved_replica_to_another_tier() -> None:
    reserved = ReplicaLoad("r", 950_000, reserved_only=True, flex=(("x", 500_000),))
    assert preemption_plan("standard", [reserved]) is None
    assert preemption_plan("enterprise", [reserved]) == Preemption("r", ("x",), 450_000)


# --- the lifecycle ------------------------------------------------------------------------------


def preempt() -> PreemptRequest:
    return PreemptRequest(812, 40, 512, "replica-1", "req-interactive")


def test_a_preempted_flex_request_ends_with_its_engine_counts_and_a_full_refund() -> None:
    state = given(*FLEX_ROUTED).when(preempt()).then(
        RequestPreempted(b.RID, 812, 40, 512, "replica-1", "req-interactive"),
        QuotaRefunded(b.RID, refunded_tokens=1800, refunded_kv_byte_seconds=10 * 2**30,
                      used_tokens=0),
    )
    assert state.status == "preempted" and state.is_terminal
    assert state.service_tier == "flex"


def test_only_flex_work_is_preempted_and_only_once() -> None:
    given(b.admitted(), b.estimated(), b.routed()).when(preempt()).then_refused("not_preemptible")
    preempted = RequestPreempted(b.RID, 812, 40, 512, "replica-1", "req-interactive")
    given(*FLEX_ROUTED, preempted).when(preempt()).then_refused("second_terminal")
    given(*FLEX_ROUTED, preempted).when(b.complete()).then_refused("second_terminal")


def test_a_preempted_request_is_billed_nothing_in_its_one_ledger_entry() -> None:
    state = b.folded((*FLEX_ROUTED, RequestPreempted(b.RID, 812, 40, 512, "r", "i"),
                      b.refunded()))
    bill = bill_terminal(state, b.price())
    assert bill is not None
    event = bill.event
    assert event.amount_micros == 0 and event.terminal == "preempted"
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (0, 0, 0)
    assert event.service_tier == "flex"


def test_a_completed_flex_request_is_billed_its_engine_counts_and_says_flex() -> None:
    state = b.folded((*FLEX_ROUTED, b.first_token(), b.completed(), b.refunded()))
    bill = bill_terminal(state, b.price())
    assert bill is not None and bill.event.service_tier == "flex"
    assert (bill.event.prompt_tokens, bill.event.completion_tokens) == (812, 300)


def test_admission_names_a_known_service_tier_and_batch_items_are_flex() -> None:
    given().when(b.admit(service_tier="priority")).then_refused("bad_service_tier")
    given().when(b.admit(batch_item="batch_1/a")).then_refused("batch_not_flex")
    state = given().when(b.admit(service_tier="flex", batch_item="batch_1/a")).then(
        b.admitted(service_tier="flex", batch_item="batch_1/a"), b.estimated()
    )
    assert state.batch_item == "batch_1/a"


def test_an_event_recorded_before_flex_existed_reads_as_interactive() -> None:
    from tollgate_llm.domain.registry import from_payload, to_payload

    payload = to_payload(b.admitted())
    del payload["service_tier"], payload["batch_item"]
    event = from_payload("RequestAdmitted", 1, payload)
    assert event.service_tier == "default" and event.batch_item == ""  # type: ignore[attr-defined]


# --- the flex price -----------------------------------------------------------------------------


def priced_view(*discounts: tuple[int, int]) -> ControlView:
    view = ControlView()
    view.apply(b.record(b.price_set(effective_at=b.at(0)), version=1, seconds=0,
                        stream_id="prices-llama-3.1-8b"))
    for i, (ppm, seconds) in enumerate(discounts):
        event = FlexDiscountSet("llama-3.1-8b", ppm, b.at(seconds))
        view.apply(b.record(event, version=2 + i, seconds=seconds,
                            stream_id="prices-llama-3.1-8b"))
    return view


def test_flex_costs_the_price_in_force_less_the_discount_in_force() -> None:
    view = priced_view((250_000, 100))
    listed = view.price(b.MODEL, b.at(50))
    assert view.prices.flex_discount_ppm(b.MODEL, b.at(50)) == DEFAULT_FLEX_DISCOUNT_PPM
    half = view.price(b.MODEL, b.at(50), "flex")
    assert half.prompt_micros_per_mtok * 2 == listed.prompt_micros_per_mtok
    quarter_off = view.price(b.MODEL, b.at(150), "flex")
    assert quarter_off.completion_micros_per_mtok == listed.completion_micros_per_mtok * 3 // 4
    assert view.price(b.MODEL, b.at(150)) == listed  # the default class is not discounted


def test_a_flex_discount_is_checked_and_never_backdated() -> None:
    view = ControlView()
    now = b.at(0)
    (event,) = decide_control(view, SetFlexDiscount("llama-3.1-8b", 500_000, now, now))
    assert event == FlexDiscountSet("llama-3.1-8b", 500_000, now)
    for bad, rule in (
        (SetFlexDiscount("llama-3.1-8b", 1_000_001, now, now), "bad_discount"),
        (SetFlexDiscount("llama-3.1-8b", -1, now, now), "bad_discount"),
        (SetFlexDiscount("", 1, now, now), "bad_model"),
        (SetFlexDiscount("m", 1, now - timedelta(seconds=1), now), "price_backdated"),
    ):
        with pytest.raises(DomainError) as err:
            decide_control(view, bad)
        assert err.value.rule == rule
