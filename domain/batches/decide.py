"""The batch stream's commands and `decide`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tollgate_llm.domain.batches.events import (
    BatchCancelRequested,
    BatchCreated,
    BatchEnded,
    BatchFailed,
    BatchFinalizing,
    BatchItemFinished,
    BatchStarted,
)
from tollgate_llm.domain.batches.files import MAX_LINES
from tollgate_llm.domain.batches.state import ENDPOINTS, BatchState
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError


@dataclass(frozen=True, slots=True)
class CreateBatch:
    batch_id: str
    tenant_id: str
    key_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: int
    total: int
    now: datetime
    metadata_json: str = "{}"
    retention: str = ""  # the creating key's tier (domain.control_plane.data_policy)


@dataclass(frozen=True, slots=True)
class StartBatch:
    pass


@dataclass(frozen=True, slots=True)
class RecordItem:
    custom_id: str
    request_id: str
    outcome: str  # completed | failed
    status_code: int


@dataclass(frozen=True, slots=True)
class CancelBatch:
    pass


@dataclass(frozen=True, slots=True)
class FinalizeBatch:
    """All items have an outcome (completed), or the window passed (expired)."""

    outcome: str


@dataclass(frozen=True, slots=True)
class EndBatch:
    """The output and error files are written: the batch ends as it was finalizing or
    cancelling."""

    output_file_id: str | None
    error_file_id: str | None


@dataclass(frozen=True, slots=True)
class FailBatch:
    code: str
    message: str


BatchCommand = (
    CreateBatch | StartBatch | RecordItem | CancelBatch | FinalizeBatch | EndBatch | FailBatch
)


def decide(state: BatchState, command: BatchCommand) -> tuple[Event, ...]:
    """The facts a command produces, () when it changes nothing (a repeat), or a DomainError."""
    match command:
        case CreateBatch():
            if state.status != "new":
                return ()  # the same batch id created again: what was recorded stands
            if command.endpoint not in ENDPOINTS:
                raise DomainError("bad_endpoint", f"endpoint must be one of {sorted(ENDPOINTS)}",
                                  field="endpoint")
            if command.window_s <= 0:
                raise DomainError("bad_window", "the completion window must be positive",
                                  field="completion_window")
            if not 1 <= command.total <= MAX_LINES:
                raise DomainError("bad_total", "a batch holds 1 to 5,000 requests")
            return (
                BatchCreated(
                    command.batch_id, command.tenant_id, command.key_id, command.input_file_id,
                    command.endpoint, command.completion_window, command.total,
                    command.now + timedelta(seconds=command.window_s), command.metadata_json,
                    command.retention,
                ),
            )
        case StartBatch():
            _require(state)
            return (BatchStarted(state.batch_id),) if state.status == "validating" else ()
        case RecordItem():
            _require(state)
            if command.outcome not in ("completed", "failed"):
                raise DomainError("bad_outcome", f"item outcome {command.outcome!r}")
            if command.custom_id in state.finished or state.ended:
                return ()  # an item ends once: a retry that raced it changes nothing
            if state.status not in ("in_progress", "cancelling", "finalizing"):
                raise DomainError("not_running", f"the batch is {state.status}")
            return (
                BatchItemFinished(state.batch_id, command.custom_id, command.request_id,
                                  command.outcome, command.status_code),
            )
        case CancelBatch():
            _require(state)
            if state.status in ("validating", "in_progress"):
                return (BatchCancelRequested(state.batch_id),)
            if state.status in ("cancelling", "cancelled"):
                return ()
            raise DomainError("not_cancellable", f"a {state.status} batch cannot be cancelled",
                              field="batch_id")
        case FinalizeBatch():
            _require(state)
            if state.status == "finalizing" or state.ended or state.status == "cancelling":
                return ()
            if command.outcome == "completed" and not state.all_finished:
                raise DomainError("items_left", "items without an outcome remain")
            if command.outcome not in ("completed", "expired"):
                raise DomainError("bad_outcome", f"finalizing as {command.outcome!r}")
            return (BatchFinalizing(state.batch_id, command.outcome),)
        case EndBatch():
            _require(state)
            if state.ended:
                return ()
            if state.status == "cancelling":
                outcome = "cancelled"
            elif state.status == "finalizing":
                outcome = state.finalizing_as
            else:
                raise DomainError("not_finalizing", f"a {state.status} batch is not ending")
            return (BatchEnded(state.batch_id, outcome, command.output_file_id,
                               command.error_file_id),)
        case FailBatch():
            _require(state)
            if state.ended:
                return ()
            return (BatchFailed(state.batch_id, command.code, command.message[:300]),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


def _require(state: BatchState) -> None:
    if state.status == "new":
        raise DomainError("unknown_batch", "no such batch", field="batch_id")
