"""Feedback on a served request, as a fact on its stream: the customer's own score
(`RecordFeedback`, `POST /v1/feedback`) and the signals seen without content (`implicit_signal`:
a client that left a stream it had started reading; `ImplicitSignals`: the same client asking
again on a larger model soon after, and a run that ended exhausted). What the router learns from
(`domain.routing`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Final

from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestCancelled
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.domain.text import check_text

__all__ = [
    "MAX_LABEL_CHARS",
    "SCORE_PPM_MAX",
    "REASK_WINDOW",
    "SOURCES",
    "Asked",
    "ImplicitSignals",
    "RecordFeedback",
    "decide_feedback",
    "implicit_signal",
]

SCORE_PPM_MAX: Final = 1_000_000
# A customer's label is a word or two ("wrong_format", "great"), not a comment: bounded so one
# caller cannot grow the log by much (invariant 15), and never the prompt or the answer.
MAX_LABEL_CHARS: Final = 64
SOURCES: Final = ("client", "cancelled", "reasked", "exhausted")
# A client that asks the same thing again this soon after an answer ended, on a model that costs
# more, did not take the answer: two minutes covers reading an answer and retrying by hand or by
# a client-side escalation, and not tomorrow's unrelated question with the same words.
REASK_WINDOW: Final = timedelta(seconds=120)
# What an edge remembers for these signals, at most (the oldest goes first): some MB of memory.
MEMORY_MAX: Final = 50_000


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


@dataclass(frozen=True, slots=True)
class Asked:
    """A request as the implicit signals remember it (nothing of its text): `ask_key` is the
    caller's API key and a digest of its messages keyed by the tenant (made at the edge, held in
    memory only, never written), `price` what orders models (a larger model costs more)."""

    request_id: str
    tenant_id: str
    model: str
    price: int
    task_class: str
    routed_from: str = ""
    ask_key: tuple[str, str, bytes] | None = None
    run: tuple[str, str] | None = None  # (tenant, run id)
    routed: bool = False  # the router chose the model (not a signal of the client's)
    ended_at: datetime | None = None  # completed at; None while in flight (or not completed)


@dataclass(slots=True)
class ImplicitSignals:
    """The two signals an edge sees without content, as implicit `FeedbackRecorded` (score 0,
    weighed like a cancelled stream): the same client asking the same messages again within
    REASK_WINDOW of a completed answer, on a model that costs more and by its own choice
    ("reasked", on the earlier request); and a run whose budget ran out ("exhausted", on the
    run's last completed request here). Bounded (MEMORY_MAX each), the clock passed in. One
    edge sees its own requests only: a re-ask that lands on another edge is not seen."""

    asks: OrderedDict[tuple[str, str, bytes], Asked] = field(default_factory=OrderedDict)
    live: dict[str, Asked] = field(default_factory=dict)  # in flight, by request id
    runs: OrderedDict[tuple[str, str], Asked] = field(default_factory=OrderedDict)
    max_entries: int = MEMORY_MAX

    def admitted(self, asked: Asked, now: datetime) -> FeedbackRecorded | None:
        """Remember `asked`; the "reasked" signal on the earlier request it repeats, if any."""
        signal = None
        key = asked.ask_key
        earlier = None if key is None else self.asks.pop(key, None)
        if (
            earlier is not None
            and earlier.ended_at is not None
            and now - earlier.ended_at <= REASK_WINDOW
            and asked.price > earlier.price
            and not asked.routed
        ):
            signal = _signal(earlier, "reasked")
        if len(self.live) >= self.max_entries:  # ends that never came (a crash, a void): oldest
            self.live.pop(next(iter(self.live)))
        self.live[asked.request_id] = asked
        return signal

    def ended(self, request_id: str, completed: bool, now: datetime) -> None:
        """A completed request may be asked again, and is its run's latest answer; another end
        (cancelled, failed, preempted) has its own signal or none, and is forgotten."""
        asked = self.live.pop(request_id, None)
        if asked is None or not completed:
            return
        asked = replace(asked, ended_at=now)
        for memory, key in ((self.asks, asked.ask_key), (self.runs, asked.run)):
            if key is None:
                continue
            memory.pop(key, None)  # type: ignore[arg-type]
            memory[key] = asked  # type: ignore[index]
            if len(memory) > self.max_entries:
                memory.popitem(last=False)

    def run_exhausted(self, tenant_id: str, run_id: str) -> FeedbackRecorded | None:
        """The run's budget ran out: its last completed answer here did not end the work. Once
        per run (the memory of it goes with the signal)."""
        last = self.runs.pop((tenant_id, run_id), None)
        return None if last is None else _signal(last, "exhausted")


def _signal(asked: Asked, source: str) -> FeedbackRecorded:
    return FeedbackRecorded(
        asked.request_id, asked.tenant_id, asked.model, asked.task_class, 0, source, "",
        asked.routed_from,
    )  # fmt: skip
