"""The request stream: given(events).when(command).then(events), and what evolve refuses."""

from __future__ import annotations

import pytest

from tests import builders as b
from tests.builders import given
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import Command, RecordFirstToken, decide
from tollgate_llm.domain.requests.events import (
    QuotaRefunded,
    RequestCancelled,
    RequestFailed,
    UsageBilled,
)
from tollgate_llm.domain.requests.evolve import _EVOLVERS, evolve, evolve_event, fold
from tollgate_llm.domain.requests.state import INITIAL, RequestState, _with

ADMITTED = (b.admitted(), b.estimated())
ROUTED = (*ADMITTED, b.routed())
STREAMING = (*ROUTED, b.first_token())
COMPLETED = (*STREAMING, b.completed(), b.refunded())


# --- decide -------------------------------------------------------------------------------------


def test_admit_records_admission_and_estimate() -> None:
    state = given().when(b.admit()).then(*ADMITTED)
    assert state.status == "admitted"
    assert state.reserved_tokens == 1800
    assert state.kv_byte_seconds == 10 * 2**30
    assert state.admitted_at == b.at(100)


def test_repeated_admit_with_same_content_records_nothing() -> None:
    given(*ADMITTED).when(b.admit()).then()


def test_admit_with_different_content_is_refused() -> None:
    given(*ADMITTED).when(b.admit(key_id="other")).then_refused("already_admitted")


def test_admit_with_negative_estimate_is_refused() -> None:
    given().when(b.admit(estimate=b.estimate(prompt_tokens=-1))).then_refused("negative_tokens")


def test_admit_with_unknown_tier_is_refused() -> None:
    given().when(b.admit(tier="platinum")).then_refused("bad_tier")


def test_reject_records_the_refusal() -> None:
    state = given().when(b.reject()).then(b.rejected())
    assert state.status == "rejected"


def test_reject_after_admission_is_refused() -> None:
    given(*ADMITTED).when(b.reject()).then_refused("already_admitted")


def test_reject_with_unknown_reason_is_refused() -> None:
    given().when(b.reject(reason="moon_phase")).then_refused("bad_reason")


def test_route_then_first_token() -> None:
    given(*ADMITTED).when(b.route()).then(b.routed())
    state = given(*ROUTED).when(b.record_first_token()).then(b.first_token())
    assert state.status == "streaming" and state.first_token


def test_route_before_admission_is_refused() -> None:
    given().when(b.route()).then_refused("not_admitted")


def test_second_route_is_refused() -> None:
    given(*ROUTED).when(b.route()).then_refused("already_routed")


def test_first_token_twice_is_refused() -> None:
    given(*STREAMING).when(b.record_first_token()).then_refused("first_token_recorded")


def test_complete_answers_terminal_and_refund_of_unused_tokens() -> None:
    # reserved 1,800; engine used 812 prompt + 300 completion = 1,112; 688 come back; all KV·s.
    state = (
        given(*STREAMING)
        .when(b.complete())
        .then(b.completed(), QuotaRefunded(b.RID, 688, 10 * 2**30, 1112))
    )
    assert state.status == "completed" and state.terminal == "RequestCompleted"
    assert state.refunded and state.used_tokens == 1112


def test_refund_is_never_negative_when_engine_used_more_than_reserved() -> None:
    produced = decide(b.folded(STREAMING), b.complete(prompt_tokens=900, completion_tokens=1500))
    refund = produced[1]
    assert isinstance(refund, QuotaRefunded)
    assert refund.refunded_tokens == 0 and refund.used_tokens == 2400


def test_cancel_before_routing_is_allowed_and_refunds_everything() -> None:
    given(*ADMITTED).when(b.cancel(prompt_tokens=0, completion_tokens=0)).then(
        RequestCancelled(b.RID, 0, 0, 0, "client_disconnected", True),
        QuotaRefunded(b.RID, 1800, 10 * 2**30, 0),
    )


def test_fail_after_first_token() -> None:
    given(*STREAMING).when(b.fail()).then(
        RequestFailed(b.RID, 812, 20, 0, "replica died"),
        QuotaRefunded(b.RID, 968, 10 * 2**30, 832),
    )


def test_expire_bills_the_larger_of_stream_and_sweeper_progress() -> None:
    state = b.folded(STREAMING)
    state = evolve(state, b.record(b.renewed(b.lease_progress(completion_tokens=70))))
    produced = decide(state, b.expire(prompt_tokens=812, completion_tokens=40))
    assert produced[0] == b.lease_expired(completion_tokens=70)


def test_expire_bills_at_least_the_prompt_the_first_token_carried() -> None:
    """An edge that died after the engine's first chunk, before any renewal: the engine had
    processed the prompt, and its count (FirstTokenStreamed v2) is billed (issue 26)."""
    state = b.folded((*ROUTED, b.first_token(prompt_tokens=812, cached_tokens=512)))
    produced = decide(state, b.expire())
    assert produced[0] == b.lease_expired(prompt_tokens=812, completion_tokens=0, cached_tokens=512)


def test_expire_takes_each_count_at_its_largest() -> None:
    """A renewal that reported no prompt yet (0) but 70 tokens, the sweeper's 812 + 40: the bill
    is 812 + 70, not whichever report is larger as a whole."""
    state = b.folded(STREAMING)
    renewal = b.renewed(b.lease_progress(prompt_tokens=0, completion_tokens=70))
    state = evolve(state, b.record(renewal))
    produced = decide(state, b.expire(prompt_tokens=812, completion_tokens=40))
    assert produced[0] == b.lease_expired(prompt_tokens=812, completion_tokens=70)


def test_a_first_token_with_more_cached_than_prompt_is_refused() -> None:
    command = RecordFirstToken(ttft_ms=5, prompt_tokens=10, cached_tokens=11)
    given(*ROUTED).when(command).then_refused("cached_exceeds_prompt")


def test_expire_without_any_progress_bills_nothing() -> None:
    produced = decide(b.folded(ROUTED), b.expire())
    assert produced[0] == b.lease_expired(prompt_tokens=0, completion_tokens=0)


@pytest.mark.parametrize(
    "command", [b.complete(), b.cancel(), b.fail(), b.expire()], ids=lambda c: type(c).__name__
)
def test_second_terminal_is_refused(command: Command) -> None:
    given(*COMPLETED).when(command).then_refused("second_terminal")


@pytest.mark.parametrize("command", [b.complete(), b.cancel(), b.fail(), b.expire(), b.bill()])
def test_nothing_happens_to_a_request_never_admitted(command: Command) -> None:
    given().when(command).then_refused("not_admitted")


def test_complete_with_negative_tokens_is_refused() -> None:
    given(*STREAMING).when(b.complete(completion_tokens=-1)).then_refused("negative_tokens")


def test_cached_tokens_cannot_exceed_prompt() -> None:
    given(*STREAMING).when(b.complete(cached_tokens=900)).then_refused("cached_exceeds_prompt")


def test_command_for_another_request_is_refused() -> None:
    given(*ROUTED).when(b.record_first_token(request_id="req-2")).then_refused("wrong_stream")


def test_command_dated_before_admission_is_refused() -> None:
    given(*ROUTED).when(b.complete(at=b.at(-1))).then_refused("before_admission")


def test_bill_posts_the_ledger_entry_once() -> None:
    # (812 − 512) × 0.20 + 512 × 0.05 + 300 × 0.60 = 265.6 micro-units → 266 (half up)
    expected = UsageBilled(
        request_id=b.RID,
        tenant_id=b.TENANT,
        key_id=b.KEY,
        model=b.MODEL,
        prompt_tokens=812,
        completion_tokens=300,
        cached_tokens=512,
        prompt_micros_per_mtok=200_000,
        completion_micros_per_mtok=600_000,
        cached_micros_per_mtok=50_000,
        amount_micros=266,
        terminal="completed",
        admitted_at=b.at(0),
        finished_at=b.at(4),
    )
    state = given(*COMPLETED).when(b.bill()).then(expected)
    assert state.billed and state.amount_micros == 266
    given(*COMPLETED, expected).when(b.bill()).then_refused("already_billed")


def test_bill_before_terminal_is_refused() -> None:
    given(*STREAMING).when(b.bill()).then_refused("not_terminal")


def test_bill_with_another_models_price_is_refused() -> None:
    given(*COMPLETED).when(b.bill(price=b.price(model="llama-3.1-70b"))).then_refused(
        "price_model_mismatch"
    )


def test_bill_a_lease_expiry_uses_its_status_as_terminal() -> None:
    produced = decide(b.folded((*ROUTED, b.lease_expired(), b.refunded())), b.bill())
    assert isinstance(produced[0], UsageBilled) and produced[0].terminal == "lease_expired"


# --- evolve -------------------------------------------------------------------------------------


def test_fold_of_the_happy_path() -> None:
    state = b.folded(b.happy_path())
    assert state.status == "completed"
    assert (state.refunded, state.billed, state.first_token) == (True, True, True)
    assert (state.prompt_tokens, state.completion_tokens, state.cached_tokens) == (812, 300, 512)
    assert state.replica_id == "replica-1"
    assert state.version == 7
    assert state.finished_at == b.at(4)


def test_redelivered_event_is_a_no_op() -> None:
    records = b.stream(*b.happy_path())
    state = fold(records)
    assert fold([*records, records[4], records[2]]) == state
    assert evolve(state, records[-1]) is state


def test_second_terminal_in_a_stream_is_loud() -> None:
    with pytest.raises(DomainError) as err:
        b.folded((*STREAMING, b.completed(), b.cancelled()))
    assert err.value.rule == "second_terminal"


def test_second_bill_in_a_stream_is_loud() -> None:
    with pytest.raises(DomainError) as err:
        b.folded((*COMPLETED, b.billed(), b.billed()))
    assert err.value.rule == "already_billed"


def test_a_gap_in_the_stream_is_loud() -> None:
    records = b.stream(*ROUTED)
    with pytest.raises(DomainError) as err:
        fold([records[0], records[2]])
    assert err.value.rule == "stream_gap"


def test_a_control_event_in_a_request_stream_is_loud() -> None:
    with pytest.raises(DomainError) as err:
        b.folded((b.admitted(), b.tenant_registered()))
    assert err.value.rule == "unknown_event"


def test_an_event_of_another_request_is_loud() -> None:
    with pytest.raises(DomainError) as err:
        b.folded((b.admitted(), b.estimated(request_id="req-2")))
    assert err.value.rule == "wrong_stream"


def test_lease_renewals_keep_the_largest_progress_and_do_not_count_as_versions() -> None:
    state = b.folded(STREAMING)
    later = b.record(b.renewed(b.lease_progress(completion_tokens=200)), stream_id="edge-edge-1")
    earlier = b.record(b.renewed(b.lease_progress(completion_tokens=100)), stream_id="edge-edge-1")
    other = b.record(b.renewed(b.lease_progress(request_id="req-9")), stream_id="edge-edge-1")
    after = fold([later, earlier, later, other], state)
    assert after.progress == b.lease_progress(completion_tokens=200)
    assert after.version == state.version


def test_evolve_event_applies_a_fact_not_yet_recorded() -> None:
    state = RequestState()
    for event in decide(state, b.admit()):
        state = evolve_event(state, event, b.at(0))
    assert state.status == "admitted" and state.version == 2


def test_status_never_moves_backwards_on_a_late_fact() -> None:
    # A first token recorded after completion (a slow edge) is applied but cannot reopen it.
    state = b.folded((*ROUTED, b.completed(), b.first_token()))
    assert state.status == "completed" and state.first_token


def test_evolve_knows_every_request_event() -> None:
    from tollgate_llm.domain.batches.events import BatchItemFinished
    from tollgate_llm.domain.registry import EVENT_CLASSES
    from tollgate_llm.domain.requests.events import LeasesRenewed

    # BatchItemFinished names the request that served an item, in the batch's own stream.
    request_events = {
        cls
        for cls in EVENT_CLASSES.values()
        if "request_id" in cls.__dataclass_fields__  # type: ignore[attr-defined]
        and cls not in (LeasesRenewed, BatchItemFinished)
    }
    assert request_events == set(_EVOLVERS)


def test_a_state_copy_with_an_unknown_field_is_refused() -> None:
    # `_with` copies the instance dict without __init__ (it keeps the fold fast); a misspelt
    # field would otherwise be added silently and read nowhere.
    with pytest.raises(DomainError) as err:
        _with(INITIAL, statuss="admitted")
    assert err.value.rule == "unknown_field"
    assert _with(INITIAL, status="admitted").status == "admitted"


def test_a_cancel_reason_outside_the_vocabulary_is_refused() -> None:
    given(*ROUTED).when(b.cancel(reason="bored")).then_refused("bad_reason")  # type: ignore[arg-type]
