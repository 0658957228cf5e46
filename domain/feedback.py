"""Feedback on a served request, as a fact on its stream: the customer's own score
(`RecordFeedback`, `POST /v1/feedback`) and the signals seen without content (`implicit_signal`:
a client that left a stream it had started reading). What the router learns from
(`domain.routing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from domain.errors import DomainError
from domain.requests.events import FeedbackRecorded, RequestCancelled
from domain.requests.state import RequestState
from domain.text import check_text

__all__ = [
    "MAX_LABEL_CHARS",
    "SCORE_PPM_MAX",
    "SOURCES",
    "RecordFeedback",
    "decide_feedback",
    "implicit_signal",
]

SCORE_PPM_MAX: Final = 1_000_000
# A customer's label is a word or two ("wrong_format", "great"), not a comment: bounded so one
# caller cannot grow the log by much (invariant 15), and never the prompt or the answer.
MAX_LABEL_CHARS: Final = 64
SOURCES: Final = ("client", "cancelled")


@dataclass(frozen=True, slots=True)
class RecordFeedback:
    request_id: str
    tenant_id: str  # the caller's: the stream was read in its tenant only
    score_ppm: int
    label: str = ""


def decide_feedback(state: RequestState, command: RecordFeedback) -> tuple[FeedbackRecorded, ...]:
    """One customer score per served request, once it has ended: a repeat with the same score
    and label answers () (the one recorded stands); a different one is refused naming what
    differs. A request of another tenant, or none, is `unknown_request`, the same refusal."""
    if not 0 <= command.score_ppm <= SCORE_PPM_MAX:
        raise DomainError("bad_score", "'score' must be within [0, 1]", field="score")
    if command.label:
        check_text(command.label, "label", max_chars=MAX_LABEL_CHARS)
    if state.status == "new" or state.tenant_id != command.tenant_id:
        raise DomainError("unknown_request", f"no request {command.request_id}", field="request_id")
    if state.status == "rejected":
        raise DomainError(
            "not_served", f"request {command.request_id} was refused: nothing was served",
            field="request_id",
        )  # fmt: skip
    if not state.is_terminal:
        raise DomainError(
            "still_in_flight", f"request {command.request_id} has not ended; send its feedback "
            "once it has", field="request_id",
        )  # fmt: skip
    if state.feedback_score_ppm is not None:
        if state.feedback_score_ppm != command.score_ppm:
            raise DomainError(
                "feedback_differs", "this request's feedback was recorded with another score",
                field="score",
            )  # fmt: skip
        if state.feedback_label != command.label:
            raise DomainError(
                "feedback_differs", "this request's feedback was recorded with another label",
                field="label",
            )  # fmt: skip
        return ()
    return (
        FeedbackRecorded(
            state.request_id, state.tenant_id, state.model, state.task_class,
            command.score_ppm, "client", command.label, state.routed_from,
        ),
    )  # fmt: skip


def implicit_signal(state: RequestState, terminal: RequestCancelled) -> FeedbackRecorded | None:
    """A client that disconnected from a stream it had started reading gave up on the answer:
    a score of 0 (weighed less than a customer's own score by the router, `IMPLICIT_WEIGHT`).
    Not for a timeout or a slow reader (ours), nor a request that had not begun to answer (the
    client left before seeing anything of the model), nor one admitted before task classes."""
    if terminal.reason != "client_disconnected" or not state.first_token or not state.task_class:
        return None
    return FeedbackRecorded(
        state.request_id, state.tenant_id, state.model, state.task_class, 0, "cancelled",
        "", state.routed_from,
    )  # fmt: skip
