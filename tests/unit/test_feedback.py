"""Feedback as facts on the request's stream (issue 32 item 1): a customer's score of its own
ended request, once; the implicit signal of a client that left a stream it was reading."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.feedback import RecordFeedback, decide_feedback
from tollgate_llm.domain.registry import from_payload, to_payload
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted
from tollgate_llm.domain.requests.evolve import fold
from tollgate_llm.domain.requests.state import RequestState

CLASS = "p1.t0.ft.r0.b7"


def ended(*extra: object) -> RequestState:
    return b.folded([
        b.admitted(), b.estimated(task_class=CLASS), b.routed(), b.first_token(), b.completed(),
        b.refunded(), *extra,  # type: ignore[list-item]
    ])  # fmt: skip


def feedback(score_ppm: int = 900_000, label: str = "", tenant: str = b.TENANT) -> RecordFeedback:
    return RecordFeedback(b.RID, tenant, score_ppm, label)


def test_a_served_request_s_feedback_is_recorded_with_its_model_and_class() -> None:
    (event,) = decide_feedback(ended(), feedback(label="good"))
    assert event == FeedbackRecorded(b.RID, b.TENANT, b.MODEL, CLASS, 900_000, "client", "good")


def test_a_repeat_answers_nothing_and_a_different_score_or_label_is_refused() -> None:
    state = ended(FeedbackRecorded(b.RID, b.TENANT, b.MODEL, CLASS, 900_000, "client", "good"))
    assert state.feedback_score_ppm == 900_000
    assert decide_feedback(state, feedback(label="good")) == ()
    for other, field in ((feedback(100_000, "good"), "score"), (feedback(label="bad"), "label")):
        with pytest.raises(DomainError) as err:
            decide_feedback(state, other)
        assert (err.value.rule, err.value.field) == ("feedback_differs", field)


@pytest.mark.parametrize(
    ("state", "rule"),
    [
        (RequestState(), "unknown_request"),  # what another tenant's stream folds to (not read)
        (b.folded([b.rejected()]), "not_served"),
        (b.folded([b.admitted(), b.estimated(), b.routed()]), "still_in_flight"),
    ],
)
def test_feedback_needs_a_request_that_was_served_and_has_ended(
    state: RequestState, rule: str
) -> None:
    with pytest.raises(DomainError) as err:
        decide_feedback(state, feedback())
    assert err.value.rule == rule
    assert err.value.field == "request_id"


def test_another_tenant_s_request_is_refused_like_an_unknown_one() -> None:
    with pytest.raises(DomainError) as err:
        decide_feedback(ended(), feedback(tenant="someone-else"))
    assert err.value.rule == "unknown_request"


@pytest.mark.parametrize(
    ("command", "field"),
    [
        (feedback(score_ppm=1_000_001), "score"),
        (feedback(score_ppm=-1), "score"),
        (feedback(label="x" * 65), "label"),
        (feedback(label="nul\x00"), "label"),
    ],
)
def test_a_score_out_of_range_or_an_unstorable_label_names_its_field(
    command: RecordFeedback, field: str
) -> None:
    with pytest.raises(DomainError) as err:
        decide_feedback(ended(), command)
    assert err.value.field == field


def test_feedback_on_a_routed_request_names_the_model_it_was_routed_from() -> None:
    routing = RequestModelRouted(
        b.RID, "auto", "llama-3.1-70b", b.MODEL, CLASS, 850_000, 800_000, "meets_bar"
    )
    state = b.folded([
        b.admitted(), b.estimated(task_class=CLASS), routing, b.routed(), b.first_token(),
        b.completed(), b.refunded(),
    ])  # fmt: skip
    (event,) = decide_feedback(state, feedback())
    assert event.routed_from == "llama-3.1-70b"


def test_a_client_that_left_a_stream_it_was_reading_is_a_zero_with_its_class() -> None:
    b.given(b.admitted(), b.estimated(task_class=CLASS), b.routed(), b.first_token()).when(
        b.cancel()
    ).then(
        b.cancelled(completion_tokens=50),
        b.refunded(refunded_tokens=938, used_tokens=862),
        FeedbackRecorded(b.RID, b.TENANT, b.MODEL, CLASS, 0, "cancelled"),
    )


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ((b.admitted(), b.estimated(task_class=CLASS), b.routed()), "client_disconnected"),
        ((b.admitted(), b.estimated(task_class=CLASS), b.routed(), b.first_token()), "timeout"),
        ((b.admitted(), b.estimated(), b.routed(), b.first_token()), "client_disconnected"),
    ],
    ids=["before-any-answer", "our-timeout", "no-task-class"],
)
def test_no_implicit_signal_where_the_client_did_not_give_up_on_an_answer(
    events: tuple[object, ...], reason: str
) -> None:
    state = b.folded(events)  # type: ignore[arg-type]
    produced = b.decide(state, b.cancel(reason=reason))
    assert not any(isinstance(e, FeedbackRecorded) for e in produced)


def test_an_implicit_signal_leaves_the_customer_s_own_feedback_open() -> None:
    state = ended(FeedbackRecorded(b.RID, b.TENANT, b.MODEL, CLASS, 0, "cancelled"))
    assert state.feedback_score_ppm is None
    assert len(decide_feedback(state, feedback())) == 1


def test_the_events_round_trip_through_their_payload() -> None:
    for event in (
        FeedbackRecorded(b.RID, b.TENANT, b.MODEL, CLASS, 1, "client", "ok", "llama-3.1-70b"),
        RequestModelRouted(b.RID, "auto", "a", "b", CLASS, 1, 2, "explore", ("b=1/2", "a=0/0")),
    ):
        again = from_payload(event.EVENT_TYPE, event.EVENT_VERSION, to_payload(event))
        assert again == event
    assert fold(b.stream(b.admitted())).version == 1
