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
    Event,
    FirstTokenStreamed,
    LeaseExpired,
    LeaseProgress,
    LeasesRenewed,
    QuotaRefunded,
    Recorded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    UsageBilled,
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
    "BillUsage",
    "Command",
    "decide",
    "evolve",
    "evolve_event",
    "fold",
]

TIERS: Final = ("free", "standard", "enterprise")
REJECT_REASONS: Final = ("requests", "tokens", "concurrency", "capacity", "retry_budget", "invalid")
TERMINAL_STATUSES: Final = frozenset({"completed", "cancelled", "failed", "lease_expired"})
# Non-terminal statuses only move forward; a late or reordered fact never moves them back.
_RANK: Final = {"new": 0, "admitted": 1, "routed": 2, "streaming": 3}


# --- state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestState:
    """A request as its events describe it. `version` is the stream_version of the last event of
    this stream applied (LeasesRenewed lives in the edge's stream and does not count)."""

    request_id: str = ""
    # new|admitted|routed|streaming|completed|cancelled|failed|lease_expired|rejected
    status: str = "new"
    tenant_id: str = ""
    key_id: str = ""
    model: str = ""
    tier: str = ""
    edge_id: str = ""
    is_retry: bool = False
    reserved_tokens: int = 0
    kv_byte_seconds: int = 0
    prompt_tokens_est: int = 0
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
    version: int = 0

    @property
    def used_tokens(self) -> int:
        """What the tokens/min dimension actually consumed: engine prompt + completion tokens
        (cached prompt tokens still occupied the context, so they count)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None


_new_object = object.__new__


def _with(state: RequestState, **changes: Any) -> RequestState:
    # dataclasses.replace re-runs the frozen __init__ (~10 µs for this many fields); copying the
    # instance dict is ~1 µs and is what keeps the fold above 200k events/s.
    fresh: RequestState = _new_object(RequestState)
    fields = fresh.__dict__
    fields.update(state.__dict__)
    fields.update(changes)
    return fresh


INITIAL: Final = RequestState()


# --- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str
    edge_id: str
    estimate: Estimate
    idempotency_key: str | None = None
    is_retry: bool = False
    stream: bool = False
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class RejectRequest:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str
    reason: str  # one of REJECT_REASONS
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
    ttft_ms: int
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
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class CancelRequest:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reason: str = "client_disconnected"  # client_disconnected | timeout
    engine_reported: bool = True
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class FailRequest:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str
    request_id: str = ""
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ExpireLease:
    """The sweeper's verdict: no renewal since `last_renewed_at`. The counts are the sweeper's
    last-known engine progress (it folds LeasesRenewed); the larger of them and the stream's own
    progress is billed. With neither, nothing is billed: an estimate never reaches an invoice."""

    last_renewed_at: datetime
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
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
            return (FirstTokenStreamed(state.request_id, command.ttft_ms),)
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
            )
        case CancelRequest():
            _require_live(state)
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
            )
        case ExpireLease():
            _require_live(state)
            reported = (command.prompt_tokens, command.completion_tokens, command.cached_tokens)
            _check_counts(*reported)
            known = (0, 0, 0) if state.progress is None else _counts(state.progress)
            counts = max(reported, known)  # counts only grow: the larger report is the later
            return _with_refund(
                state, LeaseExpired(state.request_id, *counts, command.last_renewed_at)
            )
        case BillUsage():
            return (_bill(state, command),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


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
    est = command.estimate
    _non_negative(
        prompt_tokens=est.prompt_tokens,
        reserved_output_tokens=est.reserved_output_tokens,
        kv_byte_seconds=est.kv_byte_seconds,
        tpot_us=est.tpot_us,
    )
    return (
        RequestAdmitted(
            command.request_id,
            command.tenant_id,
            command.key_id,
            command.model,
            command.tier,
            command.edge_id,
            command.idempotency_key,
            command.is_retry,
            command.stream,
        ),
        RequestEstimated(
            command.request_id,
            est.prompt_tokens,
            est.reserved_output_tokens,
            est.reserved_tokens,
            est.kv_byte_seconds,
            est.tpot_us,
        ),
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
    if base_model(price.model) != base_model(state.model):
        raise DomainError("price_model_mismatch", f"price for {price.model}, request {state.model}")
    _non_negative(
        prompt_micros_per_mtok=price.prompt_micros_per_mtok,
        completion_micros_per_mtok=price.completion_micros_per_mtok,
        cached_micros_per_mtok=price.cached_micros_per_mtok,
    )
    return UsageBilled(
        request_id=state.request_id,
        tenant_id=state.tenant_id,
        key_id=state.key_id,
        model=state.model,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        cached_tokens=state.cached_tokens,
        prompt_micros_per_mtok=price.prompt_micros_per_mtok,
        completion_micros_per_mtok=price.completion_micros_per_mtok,
        cached_micros_per_mtok=price.cached_micros_per_mtok,
        amount_micros=amount_micros(
            price, state.prompt_tokens, state.completion_tokens, state.cached_tokens
        ),
        terminal=state.status,
        admitted_at=state.admitted_at,
        finished_at=state.finished_at,
    )


def _with_refund(
    state: RequestState,
    terminal: RequestCompleted | RequestCancelled | RequestFailed | LeaseExpired,
) -> tuple[Event, ...]:
    # Tokens/min is refunded what the engine did not use; KV·s is a concurrency lease, so all of
    # it comes back the moment the request stops holding memory.
    used = terminal.prompt_tokens + terminal.completion_tokens
    refund = QuotaRefunded(
        terminal.request_id,
        refunded_tokens=max(0, state.reserved_tokens - used),
        refunded_kv_byte_seconds=state.kv_byte_seconds,
        used_tokens=used,
    )
    return (terminal, refund)


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
    # Engine counts only grow during a generation, so the larger report is the later one.
    if a is None:
        return b
    if b is None:
        return a
    return b if _counts(b) > _counts(a) else a


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
    request_id: str | None = getattr(event, "request_id", None)
    if request_id is None:
        raise DomainError("unknown_event", f"{recorded.type} does not belong to a request stream")
    if state.request_id and request_id != state.request_id:
        raise DomainError("wrong_stream", f"{recorded.type} for {request_id} on {state.request_id}")
    evolver = _EVOLVERS.get(type(event))
    if evolver is None:  # exhaustive: every request event has an evolver, anything else is loud
        raise DomainError("unknown_event", f"{recorded.type} does not belong to a request stream")
    return evolver(state, event, version, recorded.occurred_at)


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
    return _with(
        state,
        version=version,
        request_id=event.request_id,
        status=_advance(state.status, "streaming"),
        first_token=True,
        ttft_ms=event.ttft_ms,
    )


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
    RequestRejected: _rejected,
    RequestRouted: _routed,
    FirstTokenStreamed: _first_token,
    RequestCompleted: _terminal("completed"),
    RequestCancelled: _terminal("cancelled"),
    RequestFailed: _terminal("failed"),
    LeaseExpired: _terminal("lease_expired"),
    QuotaRefunded: _refunded,
    UsageBilled: _billed,
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
    event: RequestCompleted | RequestCancelled | RequestFailed | LeaseExpired,
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
    in-flight state current): it is taken as the stream's next version."""
    recorded = Recorded(
        event_id="",
        stream_id=getattr(event, "request_id", state.request_id),
        stream_version=state.version + 1,
        tenant_id=state.tenant_id,
        occurred_at=occurred_at,
        event=event,
    )
    return evolve(state, recorded)


def fold(records: Iterable[Recorded], state: RequestState = INITIAL) -> RequestState:
    """The state after applying `records` in order (from `state`, the empty request by default)."""
    for recorded in records:
        state = evolve(state, recorded)
    return state
