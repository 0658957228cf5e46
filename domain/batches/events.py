"""A batch's facts (stream_id = "batch-<batch id>")."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from tollgate_llm.domain.envelope import Event


@dataclass(frozen=True, slots=True)
class BatchCreated(Event):
    EVENT_TYPE: ClassVar[str] = "BatchCreated"
    batch_id: str
    tenant_id: str
    key_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    total: int  # requests in the input file
    expires_at: datetime
    metadata_json: str = "{}"
    # The retention tier of the key that created it, fixed for its life: "zero" deletes its
    # input once read and its output files as they are read. "" before tiers existed.
    retention: str = ""


@dataclass(frozen=True, slots=True)
class BatchStarted(Event):
    EVENT_TYPE: ClassVar[str] = "BatchStarted"
    batch_id: str


@dataclass(frozen=True, slots=True)
class BatchItemFinished(Event):
    """One item's one outcome: `completed` (in the output file, billed once at the flex price)
    or `failed` (the endpoint refused its body: in the error file, never billed)."""

    EVENT_TYPE: ClassVar[str] = "BatchItemFinished"
    batch_id: str
    custom_id: str
    request_id: str  # the request that served it (support replays it by this id)
    outcome: str  # completed | failed
    status_code: int


@dataclass(frozen=True, slots=True)
class BatchCancelRequested(Event):
    EVENT_TYPE: ClassVar[str] = "BatchCancelRequested"
    batch_id: str


@dataclass(frozen=True, slots=True)
class BatchFinalizing(Event):
    EVENT_TYPE: ClassVar[str] = "BatchFinalizing"
    batch_id: str
    outcome: str  # completed | expired


@dataclass(frozen=True, slots=True)
class BatchEnded(Event):
    EVENT_TYPE: ClassVar[str] = "BatchEnded"
    batch_id: str
    outcome: str  # completed | expired | cancelled
    output_file_id: str | None
    error_file_id: str | None


@dataclass(frozen=True, slots=True)
class BatchFailed(Event):
    EVENT_TYPE: ClassVar[str] = "BatchFailed"
    batch_id: str
    code: str
    message: str
