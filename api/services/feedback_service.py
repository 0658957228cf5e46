"""`POST /v1/feedback`: a customer's score of one of its own served requests, decided by
`domain.feedback` and appended to the request's stream through the command handler. Another
tenant's request id is answered exactly like an unknown one (its stream is read in the caller's
tenant only, so nothing of it is even decoded)."""

from __future__ import annotations

from typing import Any

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.feedback import SCORE_PPM_MAX, RecordFeedback, decide_feedback
from tollgate_llm.domain.requests.evolve import fold
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.domain.routing import QualityView
from tollgate_llm.ledger.commands import CommandHandler, StreamLoader
from tollgate_llm.ledger.store import EventStore

__all__ = ["FeedbackService"]

# Refusals the client can act on by waiting or by not repeating itself: 409, like a run's.
_CONFLICTS = frozenset({"still_in_flight", "not_served", "feedback_differs"})


class FeedbackService:
    def __init__(
        self, store: EventStore, commands: CommandHandler, quality: QualityView | None = None
    ) -> None:  # fmt: skip
        """`quality`: the router's view on this edge, which learns of a new feedback at once
        (other edges fold it from the log: ledger/quality.py)."""
        self.store = store
        self.commands = commands
        self.quality = quality

    def record(self, caller: Caller, request_id: str, score: float, label: str) -> dict[str, Any]:
        # The score as integer parts per million: events carry no floats.
        command = RecordFeedback(request_id, caller.tenant_id, round(score * SCORE_PPM_MAX), label)
        try:
            handled = self.commands.handle(
                request_id, lambda state: decide_feedback(state, command),
                self._loader(request_id, caller.tenant_id), tenant_id=caller.tenant_id,
            )  # fmt: skip
        except DomainError as exc:
            raise _error(exc, request_id) from None
        if self.quality is not None:
            for record in handled.records:
                self.quality.apply(record)
        return {
            "object": "feedback",
            "request_id": request_id,
            "score": command.score_ppm / SCORE_PPM_MAX,
            "label": command.label or None,
            # False: the same feedback was already recorded (a retry); it stands as it was.
            "recorded": bool(handled.events),
        }

    def _loader(self, request_id: str, tenant_id: str) -> StreamLoader[RequestState]:
        def load() -> tuple[RequestState, int]:
            state = fold(self.store.read_stream(request_id, tenant_id))
            return state, state.version

        return load


def _error(exc: DomainError, request_id: str) -> ApiError:
    if exc.rule == "unknown_request":
        # Word for word what GET /v1/requests/{id}/events answers for an unknown id.
        return ApiError(404, f"no request {request_id}", param="request_id",
                        code="request_not_found")  # fmt: skip
    status = 409 if exc.rule in _CONFLICTS else 400
    return ApiError(status, exc.message, param=exc.field, code=exc.rule)
