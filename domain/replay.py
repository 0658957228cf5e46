"""Support's replay of one request: re-fold its stored events step by step and say what each did
(state after, quota effect, bill) and what looks wrong. It reads events, never a projection."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tollgate_llm.domain.control_plane.state import LIMIT_FIELDS, ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.leases import LEASE_TTL_S
from tollgate_llm.domain.reconcile import account
from tollgate_llm.domain.registry import to_payload
from tollgate_llm.domain.requests.events import (
    FeedbackRecorded,
    FirstTokenStreamed,
    LeaseExpired,
    LeasesRenewed,
    PreemptionRequested,
    QuotaRefunded,
    RefusalsCounted,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestModelRouted,
    RequestPreempted,
    RequestRejected,
    RequestRouted,
    UsageBilled,
)
from tollgate_llm.domain.requests.evolve import evolve
from tollgate_llm.domain.requests.state import INITIAL, RequestState


@dataclass(frozen=True, slots=True)
class Step:
    position: int
    stream_version: int
    occurred_at: datetime
    type: str
    payload: dict[str, Any]
    status_after: str
    quota_effect: dict[str, int]  # reserved_tokens / refunded_tokens / kv_byte_seconds (+/-)
    note: str = ""


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str  # no_terminal | lease_expired | refund_mismatch | not_refunded | not_billed | ...
    detail: str


@dataclass
class Timeline:
    request_id: str
    steps: list[Step] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)
    state: RequestState = INITIAL
    limits_at_admission: dict[str, int] | None = None
    plan_at_admission: str | None = None
    replica_id: str | None = None
    occupancy_ppm_at_routing: int | None = None
    region: str | None = None  # the replica's, as RequestRouted recorded it ("": none given)
    retention: str | None = None  # the tier it ran under (RequestAdmitted), "standard" or "zero"
    ttft_ms: int | None = None
    tpot_us: int | None = None
    reserved_tokens: int = 0
    refunded_tokens: int | None = None
    used_tokens: int | None = None
    bill: dict[str, Any] | None = None
    reject: dict[str, Any] | None = None
    lease_renewals: int = 0


def replay(
    request_id: str,
    records: list[Recorded],
    control: ControlView | None,
    now: datetime,
    renewals: tuple[Recorded, ...] = (),
    lease_ttl_s: int = LEASE_TTL_S,
) -> Timeline:
    """Fold `records` (the request's stream, in order) into a timeline. `renewals` are the
    LeasesRenewed events of the request's edge that mention it; `control` answers the plan and
    limits in force at admission."""
    t = Timeline(request_id)
    seen_ids: set[str] = set()
    state = INITIAL
    for record in records:
        if record.event_id in seen_ids:
            t.anomalies.append(Anomaly("duplicate_ignored", f"event {record.event_id} seen twice"))
            continue
        seen_ids.add(record.event_id)
        effect: dict[str, int] = {}
        note = ""
        event = record.event
        if isinstance(event, RefusalsCounted):
            # Not a request's stream: the refusals of one key in one window, counted.
            t.steps.append(Step(
                position=record.position, stream_version=record.stream_version,
                occurred_at=record.occurred_at, type=record.type, payload=to_payload(event),
                status_after="rejected", quota_effect={}, note=(
                    f"{event.count} refusals ({event.reason}) of key {event.key_id} in the "
                    f"{event.window_s} s from {event.window_start.isoformat()}, past the first "
                    "ones recorded one by one: counted, their request ids not kept"
                ),
            ))  # fmt: skip
            continue
        try:
            state = evolve(state, record)
        except DomainError as exc:
            t.anomalies.append(Anomaly("corrupt_stream", f"{record.type}: {exc.rule}: {exc}"))
            note = f"not applied: {exc.rule}"
        if isinstance(event, RequestEstimated):
            t.reserved_tokens = event.reserved_tokens
            effect = {"reserved_tokens": event.reserved_tokens,
                      "kv_byte_seconds": event.kv_byte_seconds}
        elif isinstance(event, QuotaRefunded):
            t.refunded_tokens = event.refunded_tokens
            t.used_tokens = event.used_tokens
            effect = {"refunded_tokens": event.refunded_tokens,
                      "kv_byte_seconds": -event.refunded_kv_byte_seconds}
        elif isinstance(event, RequestRouted):
            t.replica_id = event.replica_id
            t.occupancy_ppm_at_routing = event.occupancy_ppm
            t.region = event.region
        elif isinstance(event, FirstTokenStreamed):
            t.ttft_ms = event.ttft_ms
        elif isinstance(event, RequestCompleted):
            t.ttft_ms = event.ttft_ms
            t.tpot_us = event.tpot_us
        elif isinstance(event, LeaseExpired):
            t.anomalies.append(Anomaly(
                "lease_expired",
                f"the edge stopped renewing at {event.last_renewed_at.isoformat()}; billed the "
                f"last known progress ({event.completion_tokens} completion tokens)",
            ))
        elif isinstance(event, RequestCancelled) and event.reason == "slow_reader":
            note = (
                "cancelled by the edge: the client read nothing for the slow-reader timeout "
                "with its stream's buffer full; the engine was stopped and billed for the "
                f"{event.completion_tokens} completion tokens it produced"
            )
        elif isinstance(event, RequestPreempted):
            note = (
                f"preempted for {event.preempted_for}: a flex request stopped at the engine to "
                f"make room for interactive work after {event.completion_tokens} completion "
                "tokens; refunded in full, billed nothing (preemption waste)"
            )
        elif isinstance(event, PreemptionRequested):
            note = (
                f"edge {event.requested_by} asked for this flex request's preemption, for "
                f"{event.preempted_for} on {event.replica_id}; the edge serving it preempts it"
            )
        elif isinstance(event, RequestModelRouted):
            note = (
                f"the router served {event.served_model} for {event.asked_model} ({event.reason}:"
                f" lower bound {event.estimate_ppm / 1e6:.3f} against the bar "
                f"{event.bar_ppm / 1e6:.3f} for class {event.task_class}; reference "
                f"{event.reference_model})"
            )
        elif isinstance(event, FeedbackRecorded):
            note = (
                f"the customer scored it {event.score_ppm / 1e6:.3f}"
                + (f" ({event.label})" if event.label else "")
                if event.source == "client"
                else "implicit signal: the client left the stream it was reading (a 0, "
                "weighed half)"
            )
        elif isinstance(event, UsageBilled):
            t.bill = to_payload(event)
        elif isinstance(event, RequestRejected):
            t.reject = to_payload(event)
        elif isinstance(event, RequestAdmitted) and control is not None:
            t.retention = event.retention or "standard"
            at = record.occurred_at
            try:
                limits = control.limits(event.tenant_id, event.model, at)
                t.limits_at_admission = {
                    name: getattr(limits, name) for name in LIMIT_FIELDS
                }
                t.plan_at_admission = control.plan(event.tenant_id, at)
            except DomainError as exc:
                t.anomalies.append(Anomaly("control_unknown", str(exc)))
        t.steps.append(Step(
            position=record.position, stream_version=record.stream_version,
            occurred_at=record.occurred_at, type=record.type, payload=to_payload(event),
            status_after=state.status, quota_effect=effect, note=note,
        ))
    t.state = state
    t.lease_renewals = sum(
        1 for r in renewals
        if isinstance(r.event, LeasesRenewed)
        and any(p.request_id == request_id for p in r.event.progress)
    )
    admitted = state.status not in ("new", "rejected")
    if admitted and not state.is_terminal:
        last = records[-1].occurred_at if records else now
        age_s = int((now - last).total_seconds())
        t.anomalies.append(Anomaly(
            "no_terminal",
            f"admitted but not ended; last event {age_s} s ago"
            + (" (beyond the lease TTL: the sweeper should expire it)" if age_s > lease_ttl_s
               else " (may still be in flight)"),
        ))
    # The refund and bill rules are finance's too (domain.reconcile); the unended request is
    # told above, with its age against the lease TTL.
    acc = account(request_id, records, now, grace_s=None)
    for finding in acc.findings:
        if finding.kind == "refunds" and acc.refunds == 0:
            t.anomalies.append(Anomaly("not_refunded", "terminal event without QuotaRefunded"))
        elif finding.kind == "bills" and acc.bills == 0:
            t.anomalies.append(Anomaly("not_billed", "terminal event without UsageBilled (yet)"))
        else:
            t.anomalies.append(Anomaly(finding.kind, finding.detail))
    return t
