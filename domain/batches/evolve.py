"""The batch stream's `evolve` and `fold`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, Final

from tollgate_llm.domain.batches.events import (
    BatchCancelRequested,
    BatchCreated,
    BatchEnded,
    BatchFailed,
    BatchFinalizing,
    BatchItemFinished,
    BatchStarted,
)
from tollgate_llm.domain.batches.state import BatchState
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.errors import DomainError


def evolve(state: BatchState, recorded: Recorded) -> BatchState:
    """Apply one recorded fact (a redelivered one, stream_version ≤ version, changes nothing)."""
    if recorded.stream_version <= state.version:
        return state
    event, at = recorded.event, recorded.occurred_at
    step = _EVOLVERS.get(type(event))
    if step is None:
        raise DomainError("unknown_event", f"{recorded.type} does not belong to a batch stream")
    return replace(step(state, event, at), version=recorded.stream_version)


def _created(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(
        state, batch_id=e.batch_id, status="validating", tenant_id=e.tenant_id,
        key_id=e.key_id, input_file_id=e.input_file_id, endpoint=e.endpoint,
        completion_window=e.completion_window, total=e.total, metadata_json=e.metadata_json,
        created_at=at, expires_at=e.expires_at, retention=e.retention,
    )


def _started(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="in_progress", in_progress_at=at)


def _item(state: BatchState, e: Any, at: datetime) -> BatchState:
    if e.custom_id in state.finished:
        raise DomainError("item_twice", f"item {e.custom_id!r} ended twice")
    done = e.outcome == "completed"
    return replace(
        state, finished=state.finished | {e.custom_id},
        completed=state.completed + done, failed=state.failed + (not done),
    )


def _cancelling(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="cancelling", cancelling_at=at)


def _finalizing(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="finalizing", finalizing_at=at, finalizing_as=e.outcome)


def _ended(state: BatchState, e: Any, at: datetime) -> BatchState:
    ended = replace(state, status=e.outcome, output_file_id=e.output_file_id,
                    error_file_id=e.error_file_id)
    if e.outcome == "completed":
        return replace(ended, completed_at=at)
    if e.outcome == "expired":
        return replace(ended, expired_at=at)
    return replace(ended, cancelled_at=at)


def _failed(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="failed", failed_at=at, error_code=e.code,
                   error_message=e.message)


_EVOLVERS: Final[dict[type, Callable[[BatchState, Any, datetime], BatchState]]] = {
    BatchCreated: _created,
    BatchStarted: _started,
    BatchItemFinished: _item,
    BatchCancelRequested: _cancelling,
    BatchFinalizing: _finalizing,
    BatchEnded: _ended,
    BatchFailed: _failed,
}


def fold(records: Iterable[Recorded], state: BatchState | None = None) -> BatchState:
    state = state or BatchState()
    for recorded in records:
        state = evolve(state, recorded)
    return state
