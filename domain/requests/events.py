"""The request stream's facts (stream_id = request id), and the one list of its terminal
events (`TERMINAL_STATUS_OF`, `TERMINAL_EVENTS`, `TERMINAL_TYPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import ClassVar, TypeAlias, TypeGuard

from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.types import TerminalStatus


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
    # The retention tier it ran under (domain/control_plane/data_policy.py): "zero" kept no
    # response for a replay. "" in events recorded before tiers existed, which were standard.
    retention: str = ""
    # The tenant's LoRA adapter `model` served it through (domain/control_plane/adapters.py),
    # by the name the client asked for; "" for the base model, and in events recorded before
    # adapters existed (an optional field, so the version stays 1).
    adapter: str = ""
    # The caller's own customer (OpenAI's `user` / `safety_identifier`, or X-Tollgate-End-User)
    # as a keyed hash per tenant (domain/governance/end_users.py), never the identifier itself;
    # "" when none was named, and in events recorded before end users (optional: version 1).
    end_user: str = ""


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
    # The request's task class (`domain.routing.task_class`): admission-time features only, what
    # the router's quality statistics are kept by. Optional (no new version): "" before it existed.
    task_class: str = ""


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
    # The replica's region ("" when it was given none, and in events recorded before regions:
    # an optional field, so the version stays 1).
    region: str = ""


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
    # ISO 4217 code of the prices and amount above: the price's (PriceSet.currency). USD for a
    # bill recorded before currencies were recorded, the only currency there was.
    currency: str = "USD"
    adapter: str = ""  # the LoRA adapter it was served through (RequestAdmitted.adapter)
    end_user: str = ""  # the end user's keyed hash (RequestAdmitted.end_user); "" for none


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


@dataclass(frozen=True, slots=True)
class RequestDowngraded(Event):
    """Recorded with the admission of a request served by another model than the one asked
    for, with the tenant's consent, because the requested one had no capacity."""

    EVENT_TYPE: ClassVar[str] = "RequestDowngraded"
    request_id: str
    requested_model: str
    served_model: str
    reason: str  # why the requested model could not take it (the router's refusal)


# --- a request's place in the hierarchy (with its admission) --------------------------------------


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
    # ISO 4217 of reserved_micros: the price's (PriceSet.currency); a budget counts only what
    # is priced in its own currency. USD for a reservation recorded before currencies were.
    currency: str = "USD"
    # The end-user level it was reserved at under its project (domain/governance/end_users.py):
    # the end user's keyed hash, or "overflow" past the project's tracked end users; "" none.
    end_user: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallsReturned(Event):
    """Recorded with the terminal event of a run's call: the tool calls the engine returned."""

    EVENT_TYPE: ClassVar[str] = "ToolCallsReturned"
    request_id: str
    run_id: str
    tool_calls: int


# --- the router's facts (domain.routing): the model chosen, and what the customer thought -----


@dataclass(frozen=True, slots=True)
class RequestModelRouted(Event):
    """Recorded with the admission of a request the router served (the tenant's consent,
    `tollgate routing allow`): the model asked for, the one it would have been served without the
    router (`reference_model`: the policy's most expensive), the one that served it, and why.
    (`RequestRouted` is the replica's choice; this is the model's.)"""

    EVENT_TYPE: ClassVar[str] = "RequestModelRouted"
    request_id: str
    asked_model: str  # "auto", or the model the request named
    reference_model: str
    served_model: str
    task_class: str
    # The served model's quality for the class as a lower confidence bound, ppm (0: no evidence).
    estimate_ppm: int
    bar_ppm: int
    # meets_bar | explore | below_bar | latched (drift) | shed_capacity
    reason: str
    # Every allowed model, cheapest first, as "<model>=<lower bound ppm>/<evidence>".
    alternatives: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FeedbackRecorded(Event):
    """A quality signal on a served request, on its stream: the customer's own
    (`POST /v1/feedback`, source "client") or one seen without content ("cancelled": the client
    left a stream it had started reading; "reasked": it asked the same again soon on a larger
    model; "exhausted": the run it belonged to ran out of budget). It carries what the router's
    statistics are kept by (tenant, serving model, task class), so they fold from these events
    alone."""

    EVENT_TYPE: ClassVar[str] = "FeedbackRecorded"
    request_id: str
    tenant_id: str
    model: str  # the model version that served the request
    task_class: str
    score_ppm: int  # 0..1,000,000
    source: str  # client | cancelled | reasked | exhausted (domain.feedback.SOURCES)
    label: str = ""  # the customer's own word for it, at most domain.routing.MAX_LABEL_CHARS
    routed_from: str = ""  # the reference model when the router chose `model` (drift reads these)
