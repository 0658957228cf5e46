"""Every fact Tollgate records: request-lifecycle and control-plane events, their envelope,
their wire form and the upcasters that read old versions.

Events are frozen dataclasses of primitives (str, int, bool, None, UTC datetime, tuples). Money is
integer micro-units, KV usage integer byte-seconds, durations integer ms/us: never a float.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias, TypeGuard, get_type_hints

from domain.errors import DomainError
from domain.types import TerminalStatus


class Event:
    """Base of every event payload. Subclasses set EVENT_TYPE and EVENT_VERSION."""

    EVENT_TYPE: ClassVar[str]
    EVENT_VERSION: ClassVar[int] = 1


# --- request lifecycle (stream_id = request id) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    EVENT_TYPE: ClassVar[str] = "RequestAdmitted"
    request_id: str
    tenant_id: str
    key_id: str
    model: str  # the model version served, e.g. "llama-3.1-8b-2026-05"
    tier: str  # free | standard | enterprise
    edge_id: str
    idempotency_key: str | None = None
    is_retry: bool = False
    stream: bool = False
    # The service class it was admitted into: "default" (interactive) | "flex" (preemptible,
    # flex-priced). Absent in events recorded before flex existed, which were all interactive.
    service_tier: str = "default"
    # The batch item it runs, "<batch id>/<custom_id>" (empty for a direct API request).
    batch_item: str = ""
    # The W3C trace id of its spans, 32 hex digits, when the edge traced it (empty otherwise, and
    # in events recorded before tracing: an optional field, so the version stays 1).
    trace_id: str = ""


@dataclass(frozen=True, slots=True)
class RequestEstimated(Event):
    """v2 added the output cap apart from the reservation (an output-length prediction may
    reserve less than the request may produce), the predictor's model version, and the request's
    shape as admission saw it (what `tollgate predictor train` learns from; never its text)."""

    EVENT_TYPE: ClassVar[str] = "RequestEstimated"
    EVENT_VERSION: ClassVar[int] = 2
    request_id: str
    prompt_tokens: int  # estimated by the edge; never billed
    reserved_output_tokens: int
    reserved_tokens: int  # prompt + reserved output: what tokens/min was charged
    kv_byte_seconds: int  # estimated KV occupancy integral reserved against the KV·s cap
    tpot_us: int  # the TPOT the estimate used (after the measured-TPOT clamp)
    output_cap_tokens: int = 0  # min(max_tokens, max_output): the engine's max_tokens
    predictor_version: str = ""  # the output predictor's model version; "" when none was used
    message_count: int = 0
    system_prompt_bucket: int = -1  # a per-tenant keyed hash of the system prompt, mod 64; -1 none


@dataclass(frozen=True, slots=True)
class RequestRejected(Event):
    EVENT_TYPE: ClassVar[str] = "RequestRejected"
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str
    reason: str  # requests | tokens | concurrency | capacity | retry_budget | invalid
    retry_after_s: int
    detail: str = ""
    is_retry: bool = False


@dataclass(frozen=True, slots=True)
class RefusalsCounted(Event):
    """Refusals of one key in one window past the first few recorded in full
    (`domain.refusals`): counted, per model, tier and reason, on a stream of its own."""

    EVENT_TYPE: ClassVar[str] = "RefusalsCounted"
    tenant_id: str
    key_id: str
    model: str  # a model Tollgate serves, or "" for a name it does not know
    tier: str
    reason: str  # as RequestRejected's
    window_start: datetime
    window_s: int
    count: int


@dataclass(frozen=True, slots=True)
class RequestRouted(Event):
    EVENT_TYPE: ClassVar[str] = "RequestRouted"
    request_id: str
    replica_id: str
    occupancy_ppm: int  # the replica's effective KV occupancy at choice, parts per million


@dataclass(frozen=True, slots=True)
class FirstTokenStreamed(Event):
    """v2 added the engine's prompt counts, which arrive with the first chunk (vLLM's continuous
    usage stats): from then on the engine has processed the prompt, and a lease expiry bills at
    least it (issue 26: an edge that died before its first renewal billed nothing)."""

    EVENT_TYPE: ClassVar[str] = "FirstTokenStreamed"
    EVENT_VERSION: ClassVar[int] = 2
    request_id: str
    ttft_ms: int
    prompt_tokens: int = 0  # engine-reported with the first chunk; 0 when it reported none
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LeaseProgress:
    """One in-flight request's progress as an edge last saw it (engine-reported counts)."""

    request_id: str
    tenant_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class LeasesRenewed(Event):
    """One per edge every 0.1 s (domain.leases.LEASE_RENEW_S) while its streams progress,
    carrying those that moved (every 0.5 s, all of them); stream_id = "edge-<edge_id>"."""

    EVENT_TYPE: ClassVar[str] = "LeasesRenewed"
    edge_id: str
    progress: tuple[LeaseProgress, ...]


@dataclass(frozen=True, slots=True)
class RequestCompleted(Event):
    EVENT_TYPE: ClassVar[str] = "RequestCompleted"
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft_ms: int
    tpot_us: int


@dataclass(frozen=True, slots=True)
class RequestCancelled(Event):
    EVENT_TYPE: ClassVar[str] = "RequestCancelled"
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reason: str  # client_disconnected | timeout | slow_reader
    engine_reported: bool  # False when counts are the edge's own (engine never reported)


@dataclass(frozen=True, slots=True)
class RequestFailed(Event):
    EVENT_TYPE: ClassVar[str] = "RequestFailed"
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    EVENT_TYPE: ClassVar[str] = "LeaseExpired"
    request_id: str
    prompt_tokens: int  # last known progress
    completion_tokens: int
    cached_tokens: int
    last_renewed_at: datetime


@dataclass(frozen=True, slots=True)
class RequestPreempted(Event):
    """A flex request the router aborted at the engine to make room for an interactive one: our
    decision, so it is refunded in full and billed nothing. The counts are what the engine
    reported it had done (the preemption waste finance sees)."""

    EVENT_TYPE: ClassVar[str] = "RequestPreempted"
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica_id: str
    preempted_for: str  # the interactive request given its room


@dataclass(frozen=True, slots=True)
class PreemptionRequested(Event):
    """An edge that needs the KV of a flex request another edge serves asks that edge to preempt
    it (`lifecycle.AskToPreempt`): the serving edge, following the log, aborts it at the engine
    and ends it with RequestPreempted. Not a terminal: the request ends by its own edge's event
    (or by lease expiry if that edge is gone)."""

    EVENT_TYPE: ClassVar[str] = "PreemptionRequested"
    request_id: str  # the flex request to preempt
    requested_by: str  # the edge id that asked
    preempted_for: str  # the interactive request that needs its room
    replica_id: str  # where both run


@dataclass(frozen=True, slots=True)
class QuotaRefunded(Event):
    EVENT_TYPE: ClassVar[str] = "QuotaRefunded"
    request_id: str
    refunded_tokens: int  # reserved_tokens - used tokens (never negative)
    refunded_kv_byte_seconds: int  # the whole KV reservation: it is concurrent, not cumulative
    used_tokens: int


@dataclass(frozen=True, slots=True)
class UsageBilled(Event):
    """The ledger entry: exactly one per admitted request."""

    EVENT_TYPE: ClassVar[str] = "UsageBilled"
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    amount_micros: int
    terminal: str  # completed | cancelled | failed | lease_expired | preempted
    admitted_at: datetime
    finished_at: datetime  # the terminal event's instant; usage is bucketed by its hour
    service_tier: str = "default"  # the prices above are this class's (flex: discounted)
    # The request's place in its tenant's hierarchy and its agent run, from its BudgetReserved
    # (None: a key of the organization, no run). Defaults, like service_tier, so that every bill
    # recorded before they existed reads as the organization's.
    workspace_id: str | None = None
    project_id: str | None = None
    run_id: str | None = None


# A request stream ends with exactly one of these (DESIGN §3), each with the status it leaves.
# Every reader names them from here (two hand-kept copies once drifted and lost preempted
# requests); tests/unit/test_defined_once.py fails when a consumer lists its own.
TERMINAL_STATUS_OF: Mapping[type[Event], TerminalStatus] = MappingProxyType({
    RequestCompleted: "completed",
    RequestCancelled: "cancelled",
    RequestFailed: "failed",
    LeaseExpired: "lease_expired",
    RequestPreempted: "preempted",
})  # fmt: skip
TERMINAL_EVENTS: tuple[type[Event], ...] = tuple(TERMINAL_STATUS_OF)
TERMINAL_TYPES: frozenset[str] = frozenset(cls.EVENT_TYPE for cls in TERMINAL_EVENTS)
# The same five as a type, for signatures (a unit test holds it to TERMINAL_EVENTS).
TerminalEvent: TypeAlias = (
    RequestCompleted | RequestCancelled | RequestFailed | LeaseExpired | RequestPreempted
)


def is_terminal(event: Event) -> TypeGuard[TerminalEvent]:
    return type(event) in TERMINAL_STATUS_OF


# --- control plane ------------------------------------------------------------------------------
# Tenant streams are "tenant-<tenant_id>"; keys and limits live in their tenant's stream so one
# optimistic-concurrency check covers a tenant's whole configuration.


@dataclass(frozen=True, slots=True)
class TenantRegistered(Event):
    EVENT_TYPE: ClassVar[str] = "TenantRegistered"
    tenant_id: str
    name: str
    plan: str
    cache_salt: str  # per-tenant prefix-cache salt sent to the engine


@dataclass(frozen=True, slots=True)
class PlanChanged(Event):
    EVENT_TYPE: ClassVar[str] = "PlanChanged"
    tenant_id: str
    plan: str


@dataclass(frozen=True, slots=True)
class LimitsSet(Event):
    """Per tenant and model; None leaves the plan's default (or the earlier override) in force."""

    EVENT_TYPE: ClassVar[str] = "LimitsSet"
    tenant_id: str
    model: str  # a model name or version, or "*" for every model
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None  # cap on concurrent estimated KV GiB·s in flight
    reserved_kv_gib_seconds: int | None = None  # enterprise floor


@dataclass(frozen=True, slots=True)
class ApiKeyIssued(Event):
    EVENT_TYPE: ClassVar[str] = "ApiKeyIssued"
    tenant_id: str
    key_id: str
    key_hash: str  # sha256 hex of the secret; the secret itself is never stored
    scope: str  # customer | finance | support | admin


@dataclass(frozen=True, slots=True)
class ApiKeyRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "ApiKeyRevoked"
    tenant_id: str
    key_id: str


@dataclass(frozen=True, slots=True)
class ReplicaRegistered(Event):
    """Stream "fleet"."""

    EVENT_TYPE: ClassVar[str] = "ReplicaRegistered"
    replica_id: str
    model: str
    url: str
    reserved_only: bool = False


@dataclass(frozen=True, slots=True)
class PriceSet(Event):
    """Stream "prices-<model>". Prices are per million tokens in micro-units of the currency."""

    EVENT_TYPE: ClassVar[str] = "PriceSet"
    model: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class FlexDiscountSet(Event):
    """Stream "prices-<model>": the flex class's discount on the model's price in force, in parts
    per million of it, from `effective_at` (never before it was recorded, like a price)."""

    EVENT_TYPE: ClassVar[str] = "FlexDiscountSet"
    model: str
    discount_ppm: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class ModelProfileRegistered(Event):
    """Stream "models-<model>": the KV shape of a model name or pinned version, in force from
    `effective_at` (a later registration supersedes it from its own instant; history is kept).
    `max_model_len` None: the replica's own /v1/models (or the built-in default) decides."""

    EVENT_TYPE: ClassVar[str] = "ModelProfileRegistered"
    model: str
    attention: str  # "gqa" (dense / grouped-query) | "mla"
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    kv_lora_rank: int
    rope_dim: int
    max_model_len: int | None
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class SloSet(Event):
    """Stream "slo-<tier>". A tier's objective from `effective_at` on (never before it was
    recorded, like prices, so a change cannot re-judge requests that already ran)."""

    EVENT_TYPE: ClassVar[str] = "SloSet"
    tier: str
    ttft_ms: int
    tpot_us: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class FallbackAllowed(Event):
    """A tenant's consent to be served `to_model` when `from_model` has no capacity (its own
    stream, like its keys and limits). Without it no other model is ever served."""

    EVENT_TYPE: ClassVar[str] = "FallbackAllowed"
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class FallbackRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "FallbackRevoked"
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class RequestDowngraded(Event):
    """Recorded with the admission of a request served by another model than the one asked
    for, with the tenant's consent, because the requested one had no capacity."""

    EVENT_TYPE: ClassVar[str] = "RequestDowngraded"
    request_id: str
    requested_model: str
    served_model: str
    reason: str  # why the requested model could not take it (the router's refusal)


# --- the hierarchy under a tenant, its budgets and agent runs (tenant stream) ----------------
# Organization (the tenant) -> workspace -> project -> API key (domain/hierarchy.py). Every level
# lives in its tenant's stream, so one optimistic-concurrency check covers the whole tree.


@dataclass(frozen=True, slots=True)
class WorkspaceCreated(Event):
    EVENT_TYPE: ClassVar[str] = "WorkspaceCreated"
    tenant_id: str
    workspace_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ProjectCreated(Event):
    EVENT_TYPE: ClassVar[str] = "ProjectCreated"
    tenant_id: str
    project_id: str
    name: str
    workspace_id: str


@dataclass(frozen=True, slots=True)
class ProjectMoved(Event):
    EVENT_TYPE: ClassVar[str] = "ProjectMoved"
    tenant_id: str
    project_id: str
    workspace_id: str  # the workspace it belongs to from now on


@dataclass(frozen=True, slots=True)
class KeyAssigned(Event):
    """An API key's project (recorded with its ApiKeyIssued, or later to move it). A key with
    none belongs to the organization directly."""

    EVENT_TYPE: ClassVar[str] = "KeyAssigned"
    tenant_id: str
    key_id: str
    project_id: str


@dataclass(frozen=True, slots=True)
class LevelLimitsSet(Event):
    """Limits at a level below the organization (the organization's are `LimitsSet`). None
    leaves the earlier value; a level with no value for a limit is bounded by its ancestors."""

    EVENT_TYPE: ClassVar[str] = "LevelLimitsSet"
    tenant_id: str
    level: str  # workspace | project | key
    level_id: str
    model: str  # a model name or version, or "*"
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetSet(Event):
    """A spend budget per calendar period at one level; `amount_micros` None removes it."""

    EVENT_TYPE: ClassVar[str] = "BudgetSet"
    tenant_id: str
    level: str  # org | workspace | project | key
    level_id: str
    period: str  # day | month
    amount_micros: int | None


@dataclass(frozen=True, slots=True)
class TimeZoneSet(Event):
    """The organization's time zone (an IANA name): where its budget days and months begin."""

    EVENT_TYPE: ClassVar[str] = "TimeZoneSet"
    tenant_id: str
    time_zone: str


@dataclass(frozen=True, slots=True)
class RunPolicySet(Event):
    """The run budget a project's runs get unless their creator gave one. None: unbounded."""

    EVENT_TYPE: ClassVar[str] = "RunPolicySet"
    tenant_id: str
    project_id: str
    max_calls: int | None = None
    max_tool_calls: int | None = None
    max_wall_ms: int | None = None
    max_cost_micros: int | None = None
    max_in_flight: int | None = None


# --- agent runs (stream "run-<tenant_id>-<run_id>") --------------------------------------------


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    EVENT_TYPE: ClassVar[str] = "RunStarted"
    tenant_id: str
    run_id: str
    project_id: str | None
    max_calls: int | None = None
    max_tool_calls: int | None = None
    max_wall_ms: int | None = None
    max_cost_micros: int | None = None
    max_in_flight: int | None = None
    implicit: bool = False  # started by its first call's X-Tollgate-Run-Id, not POST /v1/runs


@dataclass(frozen=True, slots=True)
class RunBudgetExhausted(Event):
    """The first refusal of a run's call for one dimension (calls, tool_calls, wall_clock,
    cost, in_flight, ended)."""

    EVENT_TYPE: ClassVar[str] = "RunBudgetExhausted"
    tenant_id: str
    run_id: str
    dimension: str
    refused_request_id: str  # the call refused (not a request-stream event)


@dataclass(frozen=True, slots=True)
class RunEnded(Event):
    EVENT_TYPE: ClassVar[str] = "RunEnded"
    tenant_id: str
    run_id: str


# --- a request's place in the hierarchy (request stream, with its admission) ------------------


@dataclass(frozen=True, slots=True)
class BudgetReserved(Event):
    """Recorded with the admission of a request whose path is governed below or beside the
    organization's limits (a workspace, project, key limit, any budget, a run). It carries
    what was reserved at every level of the path, so any fold can take the same reservation:
    `reserved_micros` is the request's maximum cost (prompt + reserved output at the price in
    force, never the cached rate), charged to the budget periods named here."""

    EVENT_TYPE: ClassVar[str] = "BudgetReserved"
    request_id: str
    tenant_id: str
    key_id: str
    workspace_id: str | None
    project_id: str | None
    run_id: str | None
    model: str
    day: str  # the budget day of the admission in the organization's time zone, "2026-12-02"
    month: str  # "2026-12"
    reserved_micros: int
    reserved_tokens: int
    kv_byte_seconds: int


@dataclass(frozen=True, slots=True)
class ToolCallsReturned(Event):
    """Recorded with the terminal event of a run's call: the tool calls the engine returned."""

    EVENT_TYPE: ClassVar[str] = "ToolCallsReturned"
    request_id: str
    run_id: str
    tool_calls: int


# --- batches (stream_id = "batch-<batch id>", domain/batch.py) ----------------------------------


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




# --- envelope and wire form ---------------------------------------------------------------------

EVENT_CLASSES: dict[str, type[Event]] = {
    cls.EVENT_TYPE: cls
    for cls in (
        RequestAdmitted,
        RequestEstimated,
        RequestRejected,
        RefusalsCounted,
        RequestRouted,
        FirstTokenStreamed,
        LeasesRenewed,
        RequestCompleted,
        RequestCancelled,
        RequestFailed,
        LeaseExpired,
        RequestPreempted,
        PreemptionRequested,
        QuotaRefunded,
        UsageBilled,
        TenantRegistered,
        PlanChanged,
        LimitsSet,
        ApiKeyIssued,
        ApiKeyRevoked,
        ReplicaRegistered,
        PriceSet,
        FlexDiscountSet,
        ModelProfileRegistered,
        SloSet,
        FallbackAllowed,
        FallbackRevoked,
        RequestDowngraded,
        WorkspaceCreated,
        ProjectCreated,
        ProjectMoved,
        KeyAssigned,
        LevelLimitsSet,
        BudgetSet,
        TimeZoneSet,
        RunPolicySet,
        RunStarted,
        RunBudgetExhausted,
        RunEnded,
        BudgetReserved,
        ToolCallsReturned,
        BatchCreated,
        BatchStarted,
        BatchItemFinished,
        BatchCancelRequested,
        BatchFinalizing,
        BatchEnded,
        BatchFailed,
    )
}


@dataclass(frozen=True, slots=True)
class Recorded:
    """An event as stored: the envelope the folds read. `position` is global commit order
    (0 before the store assigned it); `stream_version` counts from 1 within the stream."""

    event_id: str
    stream_id: str
    stream_version: int
    tenant_id: str
    occurred_at: datetime
    event: Event
    position: int = 0

    @property
    def type(self) -> str:
        return self.event.EVENT_TYPE


Upcaster: TypeAlias = Callable[[dict[str, Any]], dict[str, Any]]
# (type, from_version) -> function giving the payload of version from_version + 1. Pure; stored
# rows are never rewritten, they are read through these.


def _estimated_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 reserved the whole output cap, with no predictor, and did not record the shape.
    return {
        **payload,
        "output_cap_tokens": payload["reserved_output_tokens"],
        "predictor_version": "",
        "message_count": 0,
        "system_prompt_bucket": -1,
    }


def _first_token_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 carried no engine counts: unknown, so nothing a lease expiry could bill.
    return {**payload, "prompt_tokens": 0, "cached_tokens": 0}


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("RequestEstimated", 1): _estimated_v1_to_v2,
    ("FirstTokenStreamed", 1): _first_token_v1_to_v2,
}


def upcast(event_type: str, version: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    cls = EVENT_CLASSES.get(event_type)
    if cls is None:
        raise DomainError("unknown_event_type", f"unknown event type {event_type!r}")
    if version > cls.EVENT_VERSION:
        raise DomainError(
            "event_version_too_new",
            f"{event_type} v{version} is newer than this code (v{cls.EVENT_VERSION})",
        )
    data = dict(payload)
    while version < cls.EVENT_VERSION:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise DomainError("no_upcaster", f"no upcaster for {event_type} v{version}")
        data = step(data)
        version += 1
    return data


def to_payload(event: Event) -> dict[str, Any]:
    """The JSON-ready payload of an event: primitives only."""
    names = _FIELD_NAMES.get(type(event))
    if names is None:
        names = _FIELD_NAMES[type(event)] = tuple(f.name for f in dataclasses.fields(event))  # type: ignore[arg-type]
    payload = {}
    for name in names:
        value = getattr(event, name)
        kind = type(value)
        # Most values are already JSON primitives (every event is written once on the request
        # path, so this is hot); the rest, floats included (refused), go through _encode.
        plain = kind is str or kind is int or kind is bool or value is None
        payload[name] = value if plain else _encode(value)
    return payload


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def from_payload(event_type: str, version: int, payload: Mapping[str, Any]) -> Event:
    cls = EVENT_CLASSES.get(event_type)
    # The common case is the current version: no upcasting, no copy of the payload.
    if cls is None or version != cls.EVENT_VERSION:
        payload = upcast(event_type, version, payload)
        cls = EVENT_CLASSES[event_type]
    converters = _CONVERTERS.get(cls)
    if converters is None:
        converters = _converters(cls, _decoders(cls))
    if converters:
        converted = dict(payload)
        for name, convert in converters:
            value = converted.get(name)
            if value is not None:
                converted[name] = convert(value)
    else:  # most events: nothing to convert, and cls(**payload) copies nothing of it
        converted = payload  # type: ignore[assignment]
    try:
        # A payload of the current version has exactly the class's fields (to_payload wrote it).
        return cls(**converted)
    except TypeError:  # a key the class does not have: keep the fields only
        plan = _decoders(cls)
        return cls(**{name: value for name, value in converted.items() if name in plan})


def dumps(event: Event) -> str:
    return json.dumps(to_payload(event), separators=(",", ":"), sort_keys=True)


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise DomainError("naive_datetime", "event datetimes must be timezone-aware UTC")
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float):
        raise DomainError("float_in_event", "events carry no floats (money, tokens, time)")
    return value


_DECODERS: dict[type, dict[str, Callable[[Any], Any] | None]] = {}


def _decoders(cls: type) -> dict[str, Callable[[Any], Any] | None]:
    """Per event class, each field's converter from its JSON form (None: used as is). Built
    once per class: decoding is on every fold's path."""
    plan = _DECODERS.get(cls)
    if plan is None:
        plan = {}
        for f in dataclasses.fields(cls):
            hint = get_type_hints(cls)[f.name]
            if hint is datetime or hint == (datetime | None):
                plan[f.name] = parse_instant
            elif hint == tuple[LeaseProgress, ...]:
                plan[f.name] = _progress
            else:
                plan[f.name] = None
        _DECODERS[cls] = plan
    return plan


_CONVERTERS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def _converters(
    cls: type, plan: dict[str, Callable[[Any], Any] | None]
) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """The fields of `cls` whose JSON form needs converting (instants, nested records)."""
    found = _CONVERTERS.get(cls)
    if found is None:
        found = _CONVERTERS[cls] = tuple((n, fn) for n, fn in plan.items() if fn is not None)
    return found


def _progress(items: Any) -> tuple[LeaseProgress, ...]:
    return tuple(LeaseProgress(**item) for item in items)


def parse_instant(text: str) -> datetime:
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise DomainError("naive_datetime", f"instant {text!r} has no timezone")
    return parsed.astimezone(UTC)
