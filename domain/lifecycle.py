"""The request stream (stream_id = request id): its state, the commands that drive it, `decide`
(validates a command against the state and answers with new facts) and `evolve` (applies facts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from domain.cost import Estimate, Price, amount_micros, base_model
from domain.errors import DomainError
from domain.events import (
    TERMINAL_STATUS_OF,
    BudgetReserved,
    Event,
    FirstTokenStreamed,
    LeaseExpired,
    LeaseProgress,
    LeasesRenewed,
    PreemptionRequested,
    QuotaRefunded,
    Recorded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestDowngraded,
    RequestEstimated,
    RequestFailed,
    RequestPreempted,
    RequestRejected,
    RequestRouted,
    TerminalEvent,
    ToolCallsReturned,
    UsageBilled,
)
from domain.types import (
    CANCEL_REASONS,
    REJECT_REASONS,
    SERVICE_TIERS,
    TERMINAL_STATUSES,
    TIERS,
    CancelReason,
    RejectReason,
    ServiceTier,
    Status,
    Tier,
)

__all__ = [
    "TIERS",
    "REJECT_REASONS",
    "TERMINAL_STATUSES",
    "Estimate",
    "RequestState",
    "AdmitRequest",
    "RejectRequest",
    "RouteRequest",
    "RecordFirstToken",
    "CompleteRequest",
    "CancelRequest",
    "FailRequest",
    "ExpireLease",
    "PreemptRequest",
    "AskToPreempt",
    "BillUsage",
    "Command",
    "decide",
    "evolve",
    "evolve_event",
    "fold",
    "refund_due",
    "billed_counts",
]

# Non-terminal statuses only move forward; a late or reordered fact never moves them back.
_RANK: Final = {"new": 0, "admitted": 1, "routed": 2, "streaming": 3}


# --- state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestState:
    """A request as its events describe it. `version` is the stream_version of the last event of
    this stream applied (LeasesRenewed lives in the edge's stream and does not count)."""

    request_id: str = ""
    status: Status = "new"
    tenant_id: str = ""
    key_id: str = ""
    model: str = ""
    tier: str = ""
    edge_id: str = ""
    is_retry: bool = False
    reserved_tokens: int = 0
    kv_byte_seconds: int = 0
    prompt_tokens_est: int = 0
    output_cap_tokens: int = 0  # what the request may produce: the engine's max_tokens
    predictor_version: str = ""  # the output predictor behind the reservation, if any
    replica_id: str | None = None
    first_token: bool = False
    ttft_ms: int | None = None
    terminal: str | None = None  # the terminal event's type, e.g. "RequestCompleted"
    refunded: bool = False
    billed: bool = False
    amount_micros: int | None = None
    # Engine-authoritative counts, from the terminal event.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    admitted_at: datetime | None = None
    finished_at: datetime | None = None
    progress: LeaseProgress | None = None  # last engine counts an edge renewed the lease with
    downgraded_from: str | None = None  # the model asked for, when another one served it
    # Its place in the tenant's hierarchy and its agent run (BudgetReserved), when governed.
    workspace_id: str | None = None
    project_id: str | None = None
    run_id: str | None = None
    reserved_micros: int = 0
    tool_calls: int = 0
    service_tier: str = "default"  # default (interactive) | flex
    batch_item: str = ""  # "<batch id>/<custom_id>" when a batch runs it
    # Another edge asked for this flex request's preemption (PreemptionRequested): its edge id,
    # and the interactive request that needs the room. The first ask stands.
    preemption_requested_by: str = ""
    preemption_requested_for: str = ""
    version: int = 0

    @property
    def used_tokens(self) -> int:
        """What the tokens/min dimension actually consumed: engine prompt + completion tokens
        (cached prompt tokens still occupied the context, so they count)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def reserved_output_tokens(self) -> int:
        """The output tokens admission reserved: the output cap, or less when an output-length
        prediction narrowed it (never the engine's max_tokens: that is `output_cap_tokens`)."""
        return self.reserved_tokens - self.prompt_tokens_est

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None


_new_object = object.__new__
_set_attribute = object.__setattr__
_STATE_FIELDS: Final = frozenset(RequestState.__dataclass_fields__)
_FIELD_COUNT: Final = len(_STATE_FIELDS)


def _with(state: RequestState, **changes: Any) -> RequestState:
    # dataclasses.replace re-runs the frozen __init__ (~10 µs for this many fields); building the
    # new instance's dict in one merge is ~2 µs and is what keeps the folds cheap (filling an
    # empty instance dict key by key, then updating it, cost twice that: measured 4.2 against
    # 2.4 µs per copy in a request's chain of copies). The copy bypasses __init__, so a misspelt
    # field is caught here: it is the one key the merge adds to a full set of fields.
    fields = {**state.__dict__, **changes}
    if len(fields) != _FIELD_COUNT:
        unknown = ", ".join(sorted(set(changes) - _STATE_FIELDS))
        raise DomainError("unknown_field", f"RequestState has no field {unknown}")
    fresh: RequestState = _new_object(RequestState)
    _set_attribute(fresh, "__dict__", fields)
    return fresh


INITIAL: Final = RequestState()


# --- commands -----------------------------------------------------------------------------------


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
    trace_id: str = ""  # the edge's trace of it (api/tracing.py), for support's replay


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


# --- decide -------------------------------------------------------------------------------------


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
            _require_live(state)
            if state.status != "admitted":
                raise DomainError("already_routed", f"request already routed to {state.replica_id}")
            if not 0 <= command.occupancy_ppm <= 1_000_000:
                raise DomainError("bad_occupancy", "occupancy_ppm must be within [0, 1e6]")
            return (RequestRouted(state.request_id, command.replica_id, command.occupancy_ppm),)
        case RecordFirstToken():
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
        case CompleteRequest():
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
        case CancelRequest():
            _require_live(state)
            if command.reason not in CANCEL_REASONS:
                raise DomainError("bad_reason", f"cancel reason {command.reason!r}", field="reason")
            _check_counts(command.prompt_tokens, command.completion_tokens, command.cached_tokens)
            return _with_refund(
                state,
                RequestCancelled(
                    state.request_id,
                    command.prompt_tokens,
                    command.completion_tokens,
                    command.cached_tokens,
                    command.reason,
                    command.engine_reported,
                ),
                command.tool_calls,
            )
        case FailRequest():
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
        case ExpireLease():
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
            return _with_refund(
                state, LeaseExpired(state.request_id, *counts, command.last_renewed_at)
            )
        case PreemptRequest():
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
        case AskToPreempt():
            return _ask_to_preempt(state, command)
        case BillUsage():
            return (_bill(state, command),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


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
        same = (
            state.status != "rejected"
            and state.tenant_id == command.tenant_id
            and state.key_id == command.key_id
            and state.model == command.model
            and state.reserved_tokens == command.estimate.reserved_tokens
            and state.kv_byte_seconds == command.estimate.kv_byte_seconds
        )
        if same:
            return ()
        raise DomainError("already_admitted", f"request {state.request_id} is {state.status}")
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
    )
    reserved = command.reserved
    if reserved is not None and (
        reserved.request_id != command.request_id
        or reserved.tenant_id != command.tenant_id
        or reserved.reserved_tokens != est.reserved_tokens
    ):
        raise DomainError("reservation_mismatch", "the budget reservation is another request's")
    tail = () if reserved is None else (reserved,)
    if command.downgraded_from is None:
        return (admitted, estimated, *tail)
    if command.downgraded_from == command.model:
        raise DomainError("same_model", "a downgrade serves another model", field="model")
    downgraded = RequestDowngraded(
        command.request_id, command.downgraded_from, command.model, command.downgrade_reason
    )
    return (admitted, downgraded, estimated, *tail)


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
    if base_model(price.model) != base_model(state.model):
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


# --- evolve -------------------------------------------------------------------------------------


def evolve(state: RequestState, recorded: Recorded) -> RequestState:
    """Apply one recorded fact. A redelivered event (stream_version ≤ version) changes nothing;
    a gap, a foreign stream, a second terminal, refund or bill raise: a corrupt stream is loud."""
    event = recorded.event
    if type(event) is LeasesRenewed:
        return _renewed(state, event)
    version = recorded.stream_version
    if version <= state.version:
        if version < 1:
            raise DomainError("unversioned", "a recorded event has stream_version >= 1")
        return state
    if version != state.version + 1:
        raise DomainError("stream_gap", f"stream at v{state.version} got v{version}")
    return _apply(state, event, version, recorded.occurred_at)


def _apply(state: RequestState, event: Event, version: int, at: datetime) -> RequestState:
    """Apply `event` as the stream's next version `version`; the checks shared by `evolve` and
    `evolve_event`."""
    request_id: str | None = getattr(event, "request_id", None)
    if request_id is None:
        raise _not_a_request_event(event)
    if state.request_id and request_id != state.request_id:
        raise DomainError(
            "wrong_stream", f"{event.EVENT_TYPE} for {request_id} on {state.request_id}"
        )
    evolver = _EVOLVERS.get(type(event))
    if evolver is None:  # exhaustive: every request event has an evolver, anything else is loud
        raise _not_a_request_event(event)
    return evolver(state, event, version, at)


def _not_a_request_event(event: Event) -> DomainError:
    return DomainError("unknown_event", f"{event.EVENT_TYPE} does not belong to a request stream")


# One evolver per request event type, dispatched by exact type: a dict lookup instead of a chain
# of isinstance checks keeps the fold above 200k events/s.


def _estimated(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, RequestEstimated)
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        reserved_tokens=event.reserved_tokens,
        kv_byte_seconds=event.kv_byte_seconds,
        prompt_tokens_est=event.prompt_tokens,
        output_cap_tokens=event.output_cap_tokens or event.reserved_output_tokens,
        predictor_version=event.predictor_version,
    )


def _admitted(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, RequestAdmitted)
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status=_advance(state.status, "admitted"),
        tenant_id=event.tenant_id,
        key_id=event.key_id,
        model=event.model,
        tier=event.tier,
        edge_id=event.edge_id,
        is_retry=event.is_retry,
        admitted_at=at,
        service_tier=event.service_tier,
        batch_item=event.batch_item,
    )


def _routed(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, RequestRouted)
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status=_advance(state.status, "routed"),
        replica_id=event.replica_id,
    )


def _first_token(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, FirstTokenStreamed)
    progress = state.progress
    if event.prompt_tokens:  # the engine's prompt count: what a lease expiry bills at least
        progress = _later_progress(
            progress,
            LeaseProgress(
                event.request_id, state.tenant_id, event.prompt_tokens, 0, event.cached_tokens
            ),
        )
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status=_advance(state.status, "streaming"),
        first_token=True,
        ttft_ms=event.ttft_ms,
        progress=progress,
    )


def _downgraded(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, RequestDowngraded)
    return _with(
        state, version=version, request_id=event.request_id, downgraded_from=event.requested_model
    )


def _budgeted(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, BudgetReserved)
    return _with(
        state, version=version, request_id=event.request_id, workspace_id=event.workspace_id,
        project_id=event.project_id, run_id=event.run_id, reserved_micros=event.reserved_micros,
    )  # fmt: skip


def _tools(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, ToolCallsReturned)
    return _with(state, version=version, request_id=event.request_id, tool_calls=event.tool_calls)


def _refunded(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, QuotaRefunded)
    if state.refunded:
        raise DomainError("second_refund", f"request {event.request_id} refunded twice")
    return _with(state, version=version, request_id=event.request_id, refunded=True)


def _billed(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, UsageBilled)
    if state.billed:
        raise DomainError("already_billed", f"request {event.request_id} billed twice")
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        billed=True,
        amount_micros=event.amount_micros,
    )


def _preemption_requested(
    state: RequestState, event: Any, version: int, at: datetime
) -> RequestState:
    assert isinstance(event, PreemptionRequested)
    if state.preemption_requested_by:  # the first ask stands (decide never records a second)
        return _with(state, version=version)
    return _with(
        state, version=version, request_id=event.request_id,
        preemption_requested_by=event.requested_by,
        preemption_requested_for=event.preempted_for,
    )  # fmt: skip


def _rejected(state: RequestState, event: Any, version: int, at: datetime) -> RequestState:
    assert isinstance(event, RequestRejected)
    if state.status != "new":
        raise DomainError("already_admitted", f"rejection of a {state.status} request")
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status="rejected",
        tenant_id=event.tenant_id,
        key_id=event.key_id,
        model=event.model,
        tier=event.tier,
        is_retry=event.is_retry,
        finished_at=at,
    )


def _terminal(status: str) -> Callable[[RequestState, Any, int, datetime], RequestState]:
    def evolve_terminal(
        state: RequestState, event: Any, version: int, at: datetime
    ) -> RequestState:
        return _ended(state, version, at, event, status)

    return evolve_terminal


_EVOLVERS: Final[dict[type[Event], Callable[[RequestState, Any, int, datetime], RequestState]]] = {
    RequestAdmitted: _admitted,
    RequestEstimated: _estimated,
    RequestDowngraded: _downgraded,
    RequestRejected: _rejected,
    RequestRouted: _routed,
    FirstTokenStreamed: _first_token,
    **{kind: _terminal(status) for kind, status in TERMINAL_STATUS_OF.items()},
    PreemptionRequested: _preemption_requested,
    QuotaRefunded: _refunded,
    UsageBilled: _billed,
    BudgetReserved: _budgeted,
    ToolCallsReturned: _tools,
}


def _advance(current: str, to: str) -> str:
    rank = _RANK.get(current)
    if rank is None or rank >= _RANK[to]:
        return current
    return to


def _ended(
    state: RequestState,
    version: int,
    at: datetime,
    event: TerminalEvent,
    status: str,
) -> RequestState:
    if state.terminal is not None:
        raise DomainError(
            "second_terminal", f"{event.EVENT_TYPE} after {state.terminal} in {event.request_id}"
        )
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status=status,
        terminal=event.EVENT_TYPE,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
        finished_at=at,
    )


def _renewed(state: RequestState, event: LeasesRenewed) -> RequestState:
    # Renewals come from the edge's stream, so they are deduplicated by content, not version:
    # keeping the larger count makes a redelivered or reordered renewal harmless.
    for item in event.progress:
        if item.request_id == state.request_id:
            later = _later_progress(state.progress, item)
            return state if later is state.progress else _with(state, progress=later)
    return state


def evolve_event(state: RequestState, event: Event, occurred_at: datetime) -> RequestState:
    """Apply a fact just decided, before the store has recorded it (an edge keeping its
    in-flight state current): it is taken as the stream's next version. (What `evolve` does
    with that version, without building the Recorded envelope: the edge applies about six
    events per request.)"""
    if type(event) is LeasesRenewed:
        return _renewed(state, event)
    return _apply(state, event, state.version + 1, occurred_at)


def fold(records: Iterable[Recorded], state: RequestState = INITIAL) -> RequestState:
    """The state after applying `records` in order (from `state`, the empty request by default)."""
    for recorded in records:
        state = evolve(state, recorded)
    return state
