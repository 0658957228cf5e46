"""One-line example events, records and commands; every field can be overridden by keyword."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from tollgate_llm.domain.control_plane.events import (
    ApiKeyIssued,
    ApiKeyRevoked,
    LimitsSet,
    ModelProfileRegistered,
    PlanChanged,
    PriceSet,
    TenantRegistered,
)
from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.cost import Estimate, Price
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    BillUsage,
    CancelRequest,
    Command,
    CompleteRequest,
    ExpireLease,
    FailRequest,
    RecordFirstToken,
    RejectRequest,
    RouteRequest,
    decide,
)
from tollgate_llm.domain.requests.events import (
    FirstTokenStreamed,
    LeaseExpired,
    LeaseProgress,
    LeasesRenewed,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    UsageBilled,
)
from tollgate_llm.domain.requests.evolve import evolve_event, fold
from tollgate_llm.domain.requests.state import RequestState

T0 = datetime(2026, 5, 4, 12, 0, 0, tzinfo=UTC)
RID = "req-1"
TENANT = "acme"
KEY = "key-1"
MODEL = "llama-3.1-8b-2026-05"
KEY_HASH = "a" * 64

_ids = itertools.count(1)


def at(seconds: float = 0) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- lifecycle events ---------------------------------------------------------------------------


def admitted(**kw: Any) -> RequestAdmitted:
    base = RequestAdmitted(RID, TENANT, KEY, MODEL, "standard", "edge-1")
    return replace(base, **kw)


def estimated(**kw: Any) -> RequestEstimated:
    base = RequestEstimated(
        RID,
        prompt_tokens=800,
        reserved_output_tokens=1000,
        reserved_tokens=1800,
        kv_byte_seconds=10 * 2**30,
        tpot_us=50_000,
        output_cap_tokens=1000,
    )
    return replace(base, **kw)


def rejected(**kw: Any) -> RequestRejected:
    return replace(RequestRejected(RID, TENANT, KEY, MODEL, "free", "tokens", 7, "over"), **kw)


def routed(**kw: Any) -> RequestRouted:
    return replace(RequestRouted(RID, "replica-1", 400_000), **kw)


def first_token(**kw: Any) -> FirstTokenStreamed:
    return replace(FirstTokenStreamed(RID, 180), **kw)


def completed(**kw: Any) -> RequestCompleted:
    return replace(RequestCompleted(RID, 812, 300, 512, "stop", 180, 42_000), **kw)


def cancelled(**kw: Any) -> RequestCancelled:
    return replace(RequestCancelled(RID, 812, 50, 0, "client_disconnected", True), **kw)


def failed(**kw: Any) -> RequestFailed:
    return replace(RequestFailed(RID, 812, 20, 0, "replica died"), **kw)


def lease_expired(**kw: Any) -> LeaseExpired:
    return replace(LeaseExpired(RID, 812, 40, 0, at(5)), **kw)


def refunded(**kw: Any) -> QuotaRefunded:
    return replace(QuotaRefunded(RID, 688, 10 * 2**30, 1112), **kw)


def renewed(*progress: LeaseProgress, edge_id: str = "edge-1") -> LeasesRenewed:
    return LeasesRenewed(edge_id, progress or (lease_progress(),))


def lease_progress(**kw: Any) -> LeaseProgress:
    return replace(LeaseProgress(RID, TENANT, 812, 100, 0), **kw)


def billed(**kw: Any) -> UsageBilled:
    base = UsageBilled(
        request_id=RID,
        tenant_id=TENANT,
        key_id=KEY,
        model=MODEL,
        prompt_tokens=812,
        completion_tokens=300,
        cached_tokens=512,
        prompt_micros_per_mtok=200_000,
        completion_micros_per_mtok=600_000,
        cached_micros_per_mtok=50_000,
        amount_micros=266,  # 265.6 rounded half up
        terminal="completed",
        admitted_at=at(0),
        finished_at=at(20),
    )
    return replace(base, **kw)


# --- control events -----------------------------------------------------------------------------


def tenant_registered(**kw: Any) -> TenantRegistered:
    return replace(TenantRegistered(TENANT, TENANT, "standard", "salt-acme"), **kw)


def plan_changed(**kw: Any) -> PlanChanged:
    return replace(PlanChanged(TENANT, "enterprise"), **kw)


def limits_set(**kw: Any) -> LimitsSet:
    return replace(LimitsSet(TENANT, "*"), **kw)


def key_issued(**kw: Any) -> ApiKeyIssued:
    return replace(ApiKeyIssued(TENANT, KEY, KEY_HASH, "customer"), **kw)


def key_revoked(**kw: Any) -> ApiKeyRevoked:
    return replace(ApiKeyRevoked(TENANT, KEY), **kw)


def price_set(**kw: Any) -> PriceSet:
    return replace(PriceSet("llama-3.1-8b", 200_000, 600_000, 50_000, at(0)), **kw)


def model_profile_registered(**kw: Any) -> ModelProfileRegistered:
    # The tiny test Llama: 2 × 2 layers × 2 KV heads × 32 × 2 bytes = 512 B per token.
    return replace(
        ModelProfileRegistered("tiny-llama", "gqa", 2, 2, 32, 2, 0, 0, 4096, at(0)), **kw
    )


# --- envelopes ----------------------------------------------------------------------------------


def record(
    event: Event,
    *,
    version: int = 1,
    seconds: float = 0,
    stream_id: str | None = None,
    tenant_id: str = TENANT,
    event_id: str | None = None,
    position: int = 0,
) -> Recorded:
    """One recorded event; stream_id defaults to the event's request id."""
    return Recorded(
        event_id=event_id or f"evt-{next(_ids)}",
        stream_id=stream_id or getattr(event, "request_id", None) or "stream",
        stream_version=version,
        tenant_id=tenant_id,
        occurred_at=at(seconds),
        event=event,
        position=position,
    )


def stream(*events: Event, start: int = 1, step_s: float = 1.0, t0_s: float = 0) -> list[Recorded]:
    """Events recorded one after another in one stream: versions start.., one step_s apart."""
    return [
        record(e, version=start + i, seconds=t0_s + i * step_s, position=start + i)
        for i, e in enumerate(events)
    ]


def happy_path() -> list[Event]:
    """A realistic 7-event request: admitted, estimated, routed, first token, completed,
    refunded, billed."""
    return [admitted(), estimated(), routed(), first_token(), completed(), refunded(), billed()]


# --- commands -----------------------------------------------------------------------------------


def estimate(**kw: Any) -> Estimate:
    return replace(Estimate(800, 1000, 10 * 2**30, 50_000), **kw)


def admit(**kw: Any) -> AdmitRequest:
    base = AdmitRequest(RID, TENANT, KEY, MODEL, "standard", "edge-1", estimate())
    return replace(base, **kw)


def reject(**kw: Any) -> RejectRequest:
    return replace(RejectRequest(RID, TENANT, KEY, MODEL, "free", "tokens", 7, "over"), **kw)


def route(**kw: Any) -> RouteRequest:
    return replace(RouteRequest("replica-1", 400_000), **kw)


def record_first_token(**kw: Any) -> RecordFirstToken:
    return replace(RecordFirstToken(180), **kw)


def complete(**kw: Any) -> CompleteRequest:
    return replace(CompleteRequest(812, 300, 512, "stop", 180, 42_000), **kw)


def cancel(**kw: Any) -> CancelRequest:
    return replace(CancelRequest(812, 50, 0), **kw)


def fail(**kw: Any) -> FailRequest:
    return replace(FailRequest(812, 20, 0, "replica died"), **kw)


def expire(**kw: Any) -> ExpireLease:
    return replace(ExpireLease(at(5)), **kw)


def price(**kw: Any) -> Price:
    return replace(Price("llama-3.1-8b", 200_000, 600_000, 50_000), **kw)


def bill(**kw: Any) -> BillUsage:
    return replace(BillUsage(price()), **kw)


def limits(**kw: Any) -> Limits:
    return replace(Limits(600, 400_000, 32_768, 4_096, 4_096, 0), **kw)


def folded(events: Iterable[Event]) -> RequestState:
    return fold(stream(*events))


def decided(*commands: Command, at: datetime) -> list[Event]:
    """The events `commands` decide one after the other from a new request, each decided on the
    state the previous ones left (what an edge records for a request)."""
    state, events = RequestState(), []
    for command in commands:
        for event in decide(state, command):
            events.append(event)
            state = evolve_event(state, event, at)
    return events


# --- given / when / then ------------------------------------------------------------------------


class Scenario:
    """given(events).when(command).then(events) over the request lifecycle."""

    def __init__(self, events: Iterable[Event]) -> None:
        self.state = folded(events)
        self.command: Command | None = None

    def when(self, command: Command) -> Scenario:
        self.command = command
        return self

    def then(self, *expected: Event) -> RequestState:
        assert self.command is not None
        produced = decide(self.state, self.command)
        assert produced == expected, f"\n got {produced}\nwant {expected}"
        # what was decided must fold cleanly onto the state it was decided from
        records = [
            record(e, version=self.state.version + 1 + i, seconds=100 + i)
            for i, e in enumerate(produced)
        ]
        return fold(records, self.state)

    def then_refused(self, rule: str) -> None:
        from tollgate_llm.domain.errors import DomainError

        assert self.command is not None
        try:
            produced = decide(self.state, self.command)
        except DomainError as exc:
            assert exc.rule == rule, f"refused for {exc.rule!r} ({exc.message}), want {rule!r}"
            return
        raise AssertionError(f"expected refusal {rule!r}, got {produced}")


def given(*events: Event) -> Scenario:
    return Scenario(events)


# --- straight into a store (integration tests) ----------------------------------------------------

PRICED = MODEL  # priced by `append_price`
UNPRICED = "llama-3.1-70b-2026-05"  # no price unless a test sets one


def append_price(store: Any, model: str = PRICED) -> None:
    """A price for `model`, in force since yesterday."""
    import uuid

    from tollgate_llm.ledger.store import NewEvent

    when = datetime.now(UTC) - timedelta(days=1)
    new = NewEvent(
        str(uuid.uuid4()), f"prices-{model}", "", when, PriceSet(model, 150_000, 600_000, 0, when)
    )
    store.append(new.stream_id, 0, [new])


def append_request(
    store: Any, model: str = PRICED, *, end: bool = True, age_s: float = 0
) -> str:
    """An admitted and routed request `age_s` old, completed unless `end` is False; its id."""
    import uuid

    from tollgate_llm.domain.cost import Estimate
    from tollgate_llm.ledger.store import NewEvent

    rid = "req_" + uuid.uuid4().hex
    when = datetime.now(UTC) - timedelta(seconds=age_s)
    commands: list[Command] = [
        AdmitRequest(
            rid, "acme", "key-1", model, "standard", "edge-1", Estimate(100, 50, 1_000, 40_000)
        ),
        RouteRequest("replica-1", 0, request_id=rid),
    ]
    if end:
        commands.append(CompleteRequest(100, 42, 0, "stop", 30, 20_000, request_id=rid))
    events = decided(*commands, at=when)
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "acme", when, e) for e in events])
    return rid
