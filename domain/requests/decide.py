"""The request stream's commands and `decide`: validates a command against the state and
answers with new facts (a refusal is a fact too); what a terminal refunds and bills.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tollgate_llm.domain.control_plane.adapters import price_key as adapter_price_key
from tollgate_llm.domain.cost import Estimate, Price, amount_micros, base_model
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.feedback import implicit_signal
from tollgate_llm.domain.requests.events import (
    BudgetReserved,
    FirstTokenStreamed,
    LeaseExpired,
    LeaseProgress,
    PreemptionRequested,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestDowngraded,
    RequestEstimated,
    RequestFailed,
    RequestModelRouted,
    RequestPreempted,
    RequestRejected,
    RequestRouted,
    TerminalEvent,
    ToolCallsReturned,
    UsageBilled,
)
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.domain.types import (
    CANCEL_REASONS,
    REJECT_REASONS,
    SERVICE_TIERS,
    TIERS,
    CancelReason,
    RejectReason,
    ServiceTier,
    Tier,
)


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: Tier
    edge_id: str
    estimate: Estimate
    idempotency_key: str | None = None
    is_retry: bool = False
    stream: bool = False
    at: datetime | None = None
    # Served by `model` instead of this one, with the tenant's consent: `downgrade_reason` says
    # why this one could not take it.
    downgraded_from: str | None = None
    downgrade_reason: str = ""
    # The request's shape as admission saw it, recorded on RequestEstimated for the output
    # predictor's training: counts and a keyed hash bucket, never text.
    message_count: int = 0
    system_prompt_bucket: int = -1
    # Decided over a path (`domain.admission.decide_on_path`): recorded with the admission.
    reserved: BudgetReserved | None = None
    service_tier: ServiceTier = "default"
    batch_item: str = ""
    trace_id: str = ""  # the edge's trace of it (api/services/tracing.py), for support's replay
    # Its task class (domain.routing.task_class), and the router's choice of its model when the
    # tenant consented to routing (recorded with the admission, like `reserved`).
    task_class: str = ""
    routed: RequestModelRouted | None = None
    retention: str = ""  # its retention tier: "zero" | "standard" (control_plane.data_policy)
    adapter: str = ""  # the tenant's LoRA adapter of `model` it is served through, by name
    end_user: str = ""  # the end user's keyed hash (domain/governance/end_users.py)


@dataclass(frozen=True, slots=True)
class RejectRequest:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str  # a refusal may name a tier it could not check (an unknown key's), so any string
    reason: RejectReason
    retry_after_s: int
    detail: str = ""
    is_retry: bool = False
    at: datetime | None = None


# The commands below act on an existing request: `request_id` may be left empty (it is the
# stream's), and when given it must match. `at` is the instant the caller will record the facts
# at; when given, decide refuses one before the admission.


@dataclass(frozen=True, slots=True)
class RouteRequest:
    replica_id: str
    occupancy_ppm: int
    request_id: str = ""
    at: datetime | None = None
    region: str = ""  # the replica's (Choice.region)


@dataclass(frozen=True, slots=True)
class RecordFirstToken:
    """The first chunk reached the edge, with the engine's prompt counts (its continuous usage
    stats; 0 when it sent none): recorded so that a lease expiry bills at least the prompt."""

    ttft_ms: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CompleteRequest:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft_ms: int
    tpot_us: int
    tool_calls: int = 0  # returned by the engine (counted against a run)
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CancelRequest:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reason: CancelReason = "client_disconnected"
    engine_reported: bool = True
    tool_calls: int = 0  # returned by the engine (counted against a run)
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class FailRequest:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str
    tool_calls: int = 0  # returned by the engine (counted against a run)
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ExpireLease:
    """The sweeper's verdict: no renewal since `last_renewed_at`. The counts are the sweeper's
    last-known engine progress (it folds LeasesRenewed); the larger of them and the stream's own
    progress (the engine's prompt count its FirstTokenStreamed carries) is billed, count by
    count. With neither, nothing is billed: an estimate never reaches an invoice."""

    last_renewed_at: datetime
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class PreemptRequest:
    """The router aborted this flex request at the engine to give its KV to `preempted_for`.
    The counts are the engine's report of what it had done when it stopped."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica_id: str
    preempted_for: str
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AskToPreempt:
    """Edge `requested_by` needs the KV this flex request holds on `replica_id` for the
    interactive request `preempted_for`, and another edge serves it: the ask is a fact on the
    request's stream, which its own edge follows and answers by preempting it (PreemptRequest)."""

    requested_by: str
    preempted_for: str
    replica_id: str
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class BillUsage:
    """Post the ledger entry. `price` is the price in force at the request's admission instant
    (`ControlView.price(state.model, state.admitted_at)`): the customer is charged what the price
    list said when they asked, however long the generation ran."""

    price: Price
    request_id: str = ""
    at: datetime | None = None


Command = (
    AdmitRequest
    | RejectRequest
    | RouteRequest
    | RecordFirstToken
    | CompleteRequest
    | CancelRequest
    | FailRequest
    | ExpireLease
    | PreemptRequest
    | AskToPreempt
    | BillUsage
)


# --- decide ---------------------------------------------------------------------------------------


def decide(state: RequestState, command: Command) -> tuple[Event, ...]:
    """The facts a command produces in this state, or a DomainError naming the broken rule.

    Idempotent where a repeat is harmless: a repeated AdmitRequest or RejectRequest with the
    same content answers () (what was recorded stands); with different content it is an error.
    """
    if command.request_id and state.request_id and command.request_id != state.request_id:
        raise DomainError("wrong_stream", f"command for {command.request_id} on {state.request_id}")
    at = command.at
    if at is not None and state.admitted_at is not None and at < state.admitted_at:
        raise DomainError(
            "before_admission", f"{at} is before the admission at {state.admitted_at}"
        )
    match command:
        case AdmitRequest():
            return _admit(state, command)
        case RejectRequest():
            return _reject(state, command)
        case RouteRequest():
            return _route(state, command)
        case RecordFirstToken():
            return _first_token(state, command)
        case CompleteRequest():
            return _complete(state, command)
        case CancelRequest():
            return _cancel(state, command)
        case FailRequest():
            return _fail(state, command)
        case ExpireLease():
            return _expire(state, command)
        case PreemptRequest():
            return _preempt(state, command)
        case AskToPreempt():
            return _ask_to_preempt(state, command)
        case BillUsage():
            return (_bill(state, command),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


def _route(state: RequestState, command: RouteRequest) -> tuple[Event, ...]:
    _require_live(state)
    if state.status != "admitted":
        raise DomainError("already_routed", f"request already routed to {state.replica_id}")
    if not 0 <= command.occupancy_ppm <= 1_000_000:
        raise DomainError("bad_occupancy", "occupancy_ppm must be within [0, 1e6]")
    routed = RequestRouted(
        state.request_id, command.replica_id, command.occupancy_ppm, command.region
    )
    return (routed,)


def _first_token(state: RequestState, command: RecordFirstToken) -> tuple[Event, ...]:
    _require_live(state)
    if state.first_token:
        raise DomainError("first_token_recorded", "the first token was already recorded")
    if state.status != "routed":
        raise DomainError("not_routed", "a first token needs a replica")
    _non_negative(ttft_ms=command.ttft_ms)
    _check_counts(command.prompt_tokens, 0, command.cached_tokens)
    return (
        FirstTokenStreamed(
            state.request_id, command.ttft_ms, command.prompt_tokens, command.cached_tokens
        ),
    )


def _complete(state: RequestState, command: CompleteRequest) -> tuple[Event, ...]:
    _require_live(state)
    if state.status not in ("routed", "streaming"):
        raise DomainError("not_routed", "only a routed request can complete")
    _check_counts(command.prompt_tokens, command.completion_tokens, command.cached_tokens)
    _non_negative(ttft_ms=command.ttft_ms, tpot_us=command.tpot_us)
    return _with_refund(
        state,
        RequestCompleted(
            state.request_id,
            command.prompt_tokens,
            command.completion_tokens,
            command.cached_tokens,
            command.finish_reason,
            command.ttft_ms,
            command.tpot_us,
        ),
        command.tool_calls,
    )


def _cancel(state: RequestState, command: CancelRequest) -> tuple[Event, ...]:
    _require_live(state)
    if command.reason not in CANCEL_REASONS:
        raise DomainError("bad_reason", f"cancel reason {command.reason!r}", field="reason")
    _check_counts(command.prompt_tokens, command.completion_tokens, command.cached_tokens)
    cancelled = RequestCancelled(
        state.request_id,
        command.prompt_tokens,
        command.completion_tokens,
        command.cached_tokens,
        command.reason,
        command.engine_reported,
    )
    ended = _with_refund(state, cancelled, command.tool_calls)
    signal = implicit_signal(state, cancelled)
    return ended if signal is None else (*ended, signal)


def _fail(state: RequestState, command: FailRequest) -> tuple[Event, ...]:
    _require_live(state)
    _check_counts(command.prompt_tokens, command.completion_tokens, command.cached_tokens)
    return _with_refund(
        state,
        RequestFailed(
            state.request_id,
            command.prompt_tokens,
            command.completion_tokens,
            command.cached_tokens,
            command.error,
        ),
        command.tool_calls,
    )


def _expire(state: RequestState, command: ExpireLease) -> tuple[Event, ...]:
    _require_live(state)
    reported = (command.prompt_tokens, command.completion_tokens, command.cached_tokens)
    _check_counts(*reported)
    known = (0, 0, 0) if state.progress is None else _counts(state.progress)
    # Counts only grow: each the larger of the sweeper's and the stream's own (the
    # engine's prompt count from FirstTokenStreamed), taken count by count.
    counts = (
        max(reported[0], known[0]),
        max(reported[1], known[1]),
        min(max(reported[2], known[2]), max(reported[0], known[0])),
    )
    return _with_refund(state, LeaseExpired(state.request_id, *counts, command.last_renewed_at))


def _preempt(state: RequestState, command: PreemptRequest) -> tuple[Event, ...]:
    _require_live(state)
    if state.service_tier != "flex":
        raise DomainError(
            "not_preemptible", "only a flex request is preempted", field="service_tier"
        )
    _check_counts(command.prompt_tokens, command.completion_tokens, command.cached_tokens)
    return _with_refund(
        state,
        RequestPreempted(
            state.request_id,
            command.prompt_tokens,
            command.completion_tokens,
            command.cached_tokens,
            command.replica_id,
            command.preempted_for,
        ),
        used=0,
    )


def _ask_to_preempt(state: RequestState, command: AskToPreempt) -> tuple[Event, ...]:
    """At most one ask per request, and none once it ended: the asking edge decided on a view
    of the log a poll old, so the request may have ended or been asked for by a third edge
    meanwhile; both answer () (what was recorded stands), never a second terminal."""
    if state.status in ("new", "rejected"):
        raise DomainError("not_admitted", f"request is {state.status}, not admitted")
    if state.terminal is not None or state.preemption_requested_by:
        return ()
    if state.service_tier != "flex":
        raise DomainError(
            "not_preemptible", "only a flex request is preempted", field="service_tier"
        )
    if state.replica_id is not None and command.replica_id != state.replica_id:
        # A stale or corrupt view: the room would not be freed where it is needed.
        raise DomainError(
            "not_on_replica", f"request runs on {state.replica_id}, not {command.replica_id}",
            field="replica_id",
        )
    if not command.requested_by or not command.preempted_for:
        raise DomainError("missing_field", "an ask names its edge and the request it serves")
    return (
        PreemptionRequested(
            state.request_id, command.requested_by, command.preempted_for, command.replica_id
        ),
    )


def _admit(state: RequestState, command: AdmitRequest) -> tuple[Event, ...]:
    if state.status != "new":
        return _admitted_again(state, command)
    _check_classes(command)
    est = command.estimate
    _non_negative(
        prompt_tokens=est.prompt_tokens,
        reserved_output_tokens=est.reserved_output_tokens,
        kv_byte_seconds=est.kv_byte_seconds,
        tpot_us=est.tpot_us,
    )
    admitted = RequestAdmitted(
        command.request_id,
        command.tenant_id,
        command.key_id,
        command.model,
        command.tier,
        command.edge_id,
        command.idempotency_key,
        command.is_retry,
        command.stream,
        command.service_tier,
        command.batch_item,
        command.trace_id,
        command.retention,
        command.adapter,
        command.end_user,
    )
    if est.output_cap_tokens and est.output_cap_tokens < est.reserved_output_tokens:
        raise DomainError(
            "reservation_above_cap", "a request never reserves more output than it may produce",
            field="reserved_output_tokens",
        )
    estimated = RequestEstimated(
        command.request_id,
        est.prompt_tokens,
        est.reserved_output_tokens,
        est.reserved_tokens,
        est.kv_byte_seconds,
        est.tpot_us,
        est.max_output_tokens,
        est.predictor_version,
        command.message_count,
        command.system_prompt_bucket,
        command.task_class,
    )
    tail = _decided_with(command)
    if command.downgraded_from is None:
        return (admitted, estimated, *tail)
    if command.downgraded_from == command.model:
        raise DomainError("same_model", "a downgrade serves another model", field="model")
    downgraded = RequestDowngraded(
        command.request_id, command.downgraded_from, command.model, command.downgrade_reason
    )
    return (admitted, downgraded, estimated, *tail)


def _decided_with(command: AdmitRequest) -> tuple[Event, ...]:
    """What was decided with the admission and is recorded with it, each checked to be this
    request's: the router's choice of its model, then its budget reservation."""
    reserved = command.reserved
    if reserved is not None and (
        reserved.request_id != command.request_id
        or reserved.tenant_id != command.tenant_id
        or reserved.reserved_tokens != command.estimate.reserved_tokens
    ):
        raise DomainError("reservation_mismatch", "the budget reservation is another request's")
    tail: tuple[Event, ...] = () if reserved is None else (reserved,)
    routed = command.routed
    if routed is not None:
        if routed.request_id != command.request_id or routed.served_model != command.model:
            raise DomainError("routing_mismatch", "the routing decision is another request's",
                              field="model")  # fmt: skip
        tail = (routed, *tail)
    return tail


def _admitted_again(state: RequestState, command: AdmitRequest) -> tuple[Event, ...]:
    """A repeated admission: () when it is the one recorded, else an error."""
    same = (
        state.status != "rejected"
        and state.tenant_id == command.tenant_id
        and state.key_id == command.key_id
        and state.model == command.model
        and state.adapter == command.adapter
        and state.reserved_tokens == command.estimate.reserved_tokens
        and state.kv_byte_seconds == command.estimate.kv_byte_seconds
    )
    if same:
        return ()
    raise DomainError("already_admitted", f"request {state.request_id} is {state.status}")


def _check_classes(command: AdmitRequest) -> None:
    """The tier and service tier are known ones; a batch item runs in the flex class."""
    if command.tier not in TIERS:
        raise DomainError("bad_tier", f"tier {command.tier!r} is not one of {TIERS}", field="tier")
    if command.service_tier not in SERVICE_TIERS:
        raise DomainError(
            "bad_service_tier",
            f"service tier {command.service_tier!r} is not one of {SERVICE_TIERS}",
            field="service_tier",
        )
    if command.batch_item and command.service_tier != "flex":
        raise DomainError(
            "batch_not_flex", "a batch item runs in the flex class", field="batch_item"
        )


def _reject(state: RequestState, command: RejectRequest) -> tuple[Event, ...]:
    if state.status == "rejected":
        return ()
    if state.status != "new":
        raise DomainError("already_admitted", f"request {state.request_id} is {state.status}")
    if command.reason not in REJECT_REASONS:
        raise DomainError("bad_reason", f"reason {command.reason!r} not in {REJECT_REASONS}")
    _non_negative(retry_after_s=command.retry_after_s)
    return (
        RequestRejected(
            command.request_id,
            command.tenant_id,
            command.key_id,
            command.model,
            command.tier,
            command.reason,
            command.retry_after_s,
            command.detail,
            command.is_retry,
        ),
    )


def _bill(state: RequestState, command: BillUsage) -> UsageBilled:
    if state.status in ("new", "rejected"):
        raise DomainError("not_admitted", "only an admitted request is billed")
    if state.billed:
        raise DomainError("already_billed", f"request {state.request_id} is already billed")
    if state.terminal is None or state.finished_at is None or state.admitted_at is None:
        raise DomainError("not_terminal", "a request is billed after its terminal event")
    price = command.price
    own = state.adapter and price.model == adapter_price_key(state.tenant_id, state.adapter)
    if not own and base_model(price.model) != base_model(state.model):
        raise DomainError("price_model_mismatch", f"price for {price.model}, request {state.model}")
    _non_negative(
        prompt_micros_per_mtok=price.prompt_micros_per_mtok,
        completion_micros_per_mtok=price.completion_micros_per_mtok,
        cached_micros_per_mtok=price.cached_micros_per_mtok,
    )
    billed = billed_counts(state.status, state.batch_item, _counts_of(state))
    return UsageBilled(
        request_id=state.request_id,
        tenant_id=state.tenant_id,
        key_id=state.key_id,
        model=state.model,
        prompt_tokens=billed[0],
        completion_tokens=billed[1],
        cached_tokens=billed[2],
        prompt_micros_per_mtok=price.prompt_micros_per_mtok,
        completion_micros_per_mtok=price.completion_micros_per_mtok,
        cached_micros_per_mtok=price.cached_micros_per_mtok,
        amount_micros=amount_micros(price, *billed),
        terminal=state.status,
        admitted_at=state.admitted_at,
        finished_at=state.finished_at,
        service_tier=state.service_tier,
        workspace_id=state.workspace_id,
        project_id=state.project_id,
        run_id=state.run_id,
        currency=price.currency,
        adapter=state.adapter,
        end_user=state.end_user,
    )


def billed_counts(
    status: str, batch_item: str, counts: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The (prompt, completion, cached) tokens a request's ledger entry bills, from its
    engine-reported counts. Nothing for a preempted request: we stopped it, not the customer
    (what the engine had done is preemption waste, read from RequestPreempted). Nothing for a
    batch item's attempt that did not complete: the Batch API bills completed items only, and
    the item is tried again, so billing this attempt would bill the item twice."""
    if status == "preempted" or (batch_item and status != "completed"):
        return (0, 0, 0)
    return counts


def _counts_of(state: RequestState) -> tuple[int, int, int]:
    return (state.prompt_tokens, state.completion_tokens, state.cached_tokens)


def _with_refund(
    state: RequestState,
    terminal: TerminalEvent,
    tool_calls: int = 0,
    used: int | None = None,
) -> tuple[Event, ...]:
    # A preempted request gives its whole reservation back (`used=0`): our decision to stop it
    # must not cost the tenant quota either.
    if used is None:
        used = terminal.prompt_tokens + terminal.completion_tokens
    refund = QuotaRefunded(
        terminal.request_id,
        refunded_tokens=refund_due(state.reserved_tokens, used),
        refunded_kv_byte_seconds=state.kv_byte_seconds,
        used_tokens=used,
    )
    if tool_calls < 0:
        raise DomainError("negative_tokens", "tool_calls is negative", field="tool_calls")
    if state.run_id is None or not tool_calls:
        return (terminal, refund)
    return (terminal, refund, ToolCallsReturned(terminal.request_id, state.run_id, tool_calls))


def refund_due(reserved_tokens: int, used_tokens: int) -> int:
    """The tokens/min refund a terminal event owes: what the engine did not use of the
    reservation, never negative (under-reserving is charged, not refunded). KV·s is a concurrency
    lease, so all of it comes back the moment the request stops holding memory."""
    return max(0, reserved_tokens - used_tokens)


def _require_live(state: RequestState) -> None:
    if state.terminal is not None:
        raise DomainError("second_terminal", f"request already ended ({state.terminal})")
    if state.status in ("new", "rejected"):
        raise DomainError("not_admitted", f"request is {state.status}, not admitted")


def _check_counts(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
    _non_negative(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )
    if cached_tokens > prompt_tokens:
        raise DomainError(
            "cached_exceeds_prompt", "cached tokens exceed prompt tokens", field="cached_tokens"
        )


def _non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            rule = "negative_tokens" if name.endswith("tokens") else "negative_value"
            raise DomainError(rule, f"{name} must be non-negative, got {value}", field=name)


def _counts(progress: LeaseProgress) -> tuple[int, int, int]:
    return (progress.prompt_tokens, progress.completion_tokens, progress.cached_tokens)


def _later_progress(a: LeaseProgress | None, b: LeaseProgress | None) -> LeaseProgress | None:
    # Engine counts only grow during a generation, so each count's larger report is the later
    # one (count by count: the first token's report has the prompt, a renewal may not yet).
    if a is None:
        return b
    if b is None:
        return a
    ca, cb = _counts(a), _counts(b)
    if all(x >= y for x, y in zip(cb, ca, strict=True)):
        return b
    if all(x >= y for x, y in zip(ca, cb, strict=True)):
        return a
    return LeaseProgress(
        a.request_id, a.tenant_id, *(max(x, y) for x, y in zip(ca, cb, strict=True))
    )
