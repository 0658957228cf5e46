"""Pure projection specs: for each read model, which row an event touches (`key`) and the row
after it (`project`). The ledger's runner upserts the rows and its checkpoint in one transaction,
which is what makes the additive `usage_hourly` safe under redelivery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, timedelta
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.events import (
    TERMINAL_STATUS_OF,
    FirstTokenStreamed,
    LeaseExpired,
    RefusalsCounted,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestDowngraded,
    RequestFailed,
    RequestPreempted,
    RequestRejected,
    RequestRouted,
    TerminalEvent,
    UsageBilled,
    is_terminal,
)

__all__ = [
    "Row", "ProjectionSpec", "REQUEST_LOG", "USAGE_HOURLY", "LEDGER_ENTRIES", "PROJECTIONS",
    "PROJECTIONS_BY_NAME",
]  # fmt: skip

Row: TypeAlias = dict[str, Any]  # primitives only: int, str, None, aware UTC datetime


@dataclass(frozen=True)
class ProjectionSpec:
    name: str  # also the table name
    key_columns: tuple[str, ...]
    columns: tuple[str, ...]  # every column, key columns first
    key: Callable[[Recorded], tuple[Any, ...] | None]  # None: this event does not touch the view
    project: Callable[[Row | None, Recorded], Row | None]  # the new row; None deletes it
    # True for a record no earlier event can have made a row for (its row's first), so a runner
    # that has not applied it yet need not look its row up: most rows are made and finished
    # within one batch, and their reads were most of a runner's queries.
    opens_row: Callable[[Recorded], bool] = lambda _recorded: False


# --- request_log: one row per request, for support -----------------------------------------------

REQUEST_LOG_COLUMNS: Final = (
    "request_id",
    "tenant_id",
    "key_id",
    "model",
    "tier",
    "status",
    "admitted_at",
    "finished_at",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "tpot_us",
    "finish_reason",
    "replica_id",
    "reject_reason",
    "requested_model",
    "service_tier",
    "refusals",  # a RefusalsCounted row: how many refusals it stands for (else NULL: one)
    "region",  # the replica's region (RequestRouted); NULL before regions, "" for none given
    "retention",  # the tier it ran under (RequestAdmitted): standard | zero
    "adapter",  # the tenant's LoRA adapter it was served through (RequestAdmitted); NULL: none
    "end_user",  # the end user's keyed hash per tenant (RequestAdmitted); NULL: none named
)
_LOGGED: Final = (
    RequestAdmitted,
    RequestDowngraded,
    RequestRejected,
    RequestRouted,
    FirstTokenStreamed,
)
_TERMINAL_STATUS: Final = frozenset({*TERMINAL_STATUS_OF.values(), "rejected"})
_RANK: Final = {"admitted": 1, "routed": 2, "streaming": 3}
# Every status a request_log row can hold: what support may filter on.
REQUEST_LOG_STATUSES: Final = (*_RANK, *sorted(_TERMINAL_STATUS))


def _request_log_key(recorded: Recorded) -> tuple[Any, ...] | None:
    event = recorded.event
    if isinstance(event, _LOGGED) or is_terminal(event):
        return (event.request_id,)
    if type(event) is RefusalsCounted:
        return (recorded.stream_id,)
    return None


def _opens_request_log_row(recorded: Recorded) -> bool:
    # Only a request's own events touch its row (keyed by the request id, which is the stream
    # id), so the first event of the stream comes before every other.
    return recorded.stream_version == 1 and _request_log_key(recorded) == (recorded.stream_id,)


def project_request_log(row: Row | None, recorded: Recorded) -> Row | None:
    event = recorded.event
    at = recorded.occurred_at
    new: Row = dict(row) if row is not None else _empty_log_row(recorded)
    match event:
        case RequestAdmitted():
            new.update(
                tenant_id=event.tenant_id,
                key_id=event.key_id,
                model=event.model,
                tier=event.tier,
                admitted_at=at,
                service_tier=event.service_tier,
                retention=event.retention or "standard",
                adapter=event.adapter or None,
                end_user=event.end_user or None,
            )
            _advance(new, "admitted")
        case RequestRejected():
            # A refused request was never admitted: its admitted_at is the instant it was
            # decided, so support finds it in the tenant's log beside the admitted ones.
            _refused(new, event, at, at)
        case RefusalsCounted():
            # One row for the window's counted refusals, so support sees them and goodput
            # counts them: decided in [window_start, window end), ended at the window's end.
            end = event.window_start + timedelta(seconds=event.window_s)
            _refused(new, event, event.window_start, end)
            new["refusals"] = event.count
        case RequestDowngraded():
            new["requested_model"] = event.requested_model
        case RequestRouted():
            new["replica_id"] = event.replica_id
            new["region"] = event.region
            _advance(new, "routed")
        case FirstTokenStreamed():
            new["ttft_ms"] = event.ttft_ms
            _advance(new, "streaming")
        case RequestCompleted():
            _finish(new, event, at, "completed", event.finish_reason)
            new.update(ttft_ms=event.ttft_ms, tpot_us=event.tpot_us)
        case RequestCancelled():
            _finish(new, event, at, "cancelled", event.reason)
        case RequestFailed():
            _finish(new, event, at, "failed", "error")
        case LeaseExpired():
            _finish(new, event, at, "lease_expired", "lease_expired")
        case RequestPreempted():
            _finish(new, event, at, "preempted", "preempted")
        case _:
            return row
    return new


def _refused(row: Row, event: RequestRejected | RefusalsCounted, decided: Any, ended: Any) -> None:
    row.update(
        tenant_id=event.tenant_id,
        key_id=event.key_id,
        model=event.model,
        tier=event.tier,
        status="rejected",
        admitted_at=decided,
        finished_at=ended,
        reject_reason=event.reason,
    )


def _empty_log_row(recorded: Recorded) -> Row:
    row: Row = dict.fromkeys(REQUEST_LOG_COLUMNS)
    row["request_id"] = recorded.stream_id
    row["tenant_id"] = recorded.tenant_id
    row["service_tier"] = "default"
    return row


def _advance(row: Row, status: str) -> None:
    # A reordered or late non-terminal fact never moves a row backwards.
    current = row.get("status")
    if current in _TERMINAL_STATUS:
        return
    if current is None or _RANK.get(current, 0) < _RANK[status]:
        row["status"] = status


def _finish(
    row: Row,
    event: TerminalEvent,
    at: Any,
    status: str,
    finish_reason: str,
) -> None:
    row.update(
        status=status,
        finished_at=at,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
        finish_reason=finish_reason,
    )


REQUEST_LOG: Final = ProjectionSpec(
    name="request_log",
    key_columns=("request_id",),
    columns=REQUEST_LOG_COLUMNS,
    key=_request_log_key,
    project=project_request_log,
    opens_row=_opens_request_log_row,
)


# --- usage_hourly: what billing sums, from UsageBilled only --------------------------------------

USAGE_HOURLY_COLUMNS: Final = (
    "tenant_id",
    "model",
    "hour",
    "currency",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "amount_micros",
)


def _usage_hourly_key(recorded: Recorded) -> tuple[Any, ...] | None:
    event = recorded.event
    if type(event) is not UsageBilled:
        return None
    hour = event.finished_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return (event.tenant_id, event.model, hour, event.currency)


def project_usage_hourly(row: Row | None, recorded: Recorded) -> Row | None:
    """Adds one ledger entry to its (tenant, model, hour, currency) bucket: amounts in two
    currencies are never summed. Additive, so exactly-once rests
    on the runner committing the row and its checkpoint together (DESIGN §6)."""
    event = recorded.event
    if type(event) is not UsageBilled:
        return row
    key = _usage_hourly_key(recorded)
    assert key is not None
    base: Row = (
        dict(row)
        if row is not None
        else {
            "tenant_id": key[0],
            "model": key[1],
            "hour": key[2],
            "currency": key[3],
            "requests": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "amount_micros": 0,
        }
    )
    base["requests"] += 1
    base["prompt_tokens"] += event.prompt_tokens
    base["completion_tokens"] += event.completion_tokens
    base["cached_tokens"] += event.cached_tokens
    base["amount_micros"] += event.amount_micros
    return base


USAGE_HOURLY: Final = ProjectionSpec(
    name="usage_hourly",
    key_columns=("tenant_id", "model", "hour", "currency"),
    columns=USAGE_HOURLY_COLUMNS,
    key=_usage_hourly_key,
    project=project_usage_hourly,
)


# --- ledger_entries: one immutable row per billed request ----------------------------------------

LEDGER_ENTRIES_COLUMNS: Final = (
    "request_id",
    "tenant_id",
    "key_id",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "prompt_micros_per_mtok",
    "completion_micros_per_mtok",
    "cached_micros_per_mtok",
    "amount_micros",
    "terminal",
    "admitted_at",
    "finished_at",
    "billed_at",
    "position",
    "service_tier",
    "workspace_id",
    "project_id",
    "run_id",
    "currency",
    "adapter",
    "end_user",
)


def _ledger_key(recorded: Recorded) -> tuple[Any, ...] | None:
    event = recorded.event
    if type(event) is not UsageBilled:
        return None
    return (event.request_id,)


def project_ledger_entry(row: Row | None, recorded: Recorded) -> Row | None:
    """The entry is posted once and never edited: a redelivered UsageBilled keeps the first row."""
    event = recorded.event
    if type(event) is not UsageBilled or row is not None:
        return row
    return {
        "request_id": event.request_id,
        "tenant_id": event.tenant_id,
        "key_id": event.key_id,
        "model": event.model,
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "cached_tokens": event.cached_tokens,
        "prompt_micros_per_mtok": event.prompt_micros_per_mtok,
        "completion_micros_per_mtok": event.completion_micros_per_mtok,
        "cached_micros_per_mtok": event.cached_micros_per_mtok,
        "amount_micros": event.amount_micros,
        "terminal": event.terminal,
        "admitted_at": event.admitted_at,
        "finished_at": event.finished_at,
        "billed_at": recorded.occurred_at,
        "position": recorded.position,
        "service_tier": event.service_tier,
        "workspace_id": event.workspace_id,
        "project_id": event.project_id,
        "run_id": event.run_id,
        "currency": event.currency,
        "adapter": event.adapter or None,
        "end_user": event.end_user or None,
    }


LEDGER_ENTRIES: Final = ProjectionSpec(
    name="ledger_entries",
    key_columns=("request_id",),
    columns=LEDGER_ENTRIES_COLUMNS,
    key=_ledger_key,
    project=project_ledger_entry,
)

# Every read model, each run async by a worker (none inline with the append). Every runner and
# rebuild names them from here: a view missing from one list would silently stop being written.
PROJECTIONS: Final = (REQUEST_LOG, USAGE_HOURLY, LEDGER_ENTRIES)
PROJECTIONS_BY_NAME: Final[Mapping[str, ProjectionSpec]] = MappingProxyType(
    {spec.name: spec for spec in PROJECTIONS}
)
