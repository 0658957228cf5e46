"""The exact account of one request, checked against the invariants (DESIGN §4, 2 and 3): one
terminal event, one refund of reserved − used, one bill of the terminal's engine counts.

Finance's reconciliation report and support's replay both ask this of the same events, so the
rules are written once, here, in terms of the events themselves (read through the store and its
upcasters), never of stored JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.decide import billed_counts, refund_due
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    TERMINAL_STATUS_OF,
    QuotaRefunded,
    RequestAdmitted,
    RequestEstimated,
    RequestPreempted,
    TerminalEvent,
    UsageBilled,
)

__all__ = ["Finding", "RequestAccount", "account"]

_TERMINALS: Final = tuple(TERMINAL_EVENTS)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # no_terminal | terminals | refunds | refund_mismatch | bills | bill_mismatch
    detail: str


@dataclass(frozen=True, slots=True)
class RequestAccount:
    request_id: str
    admitted_at: datetime | None
    in_flight: bool  # admitted, not ended, and younger than the grace period
    terminals: int
    refunds: int
    bills: int
    reserved_tokens: int
    refunded_tokens: int
    used_tokens: int
    billed_tokens: int
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings


def account(
    request_id: str, records: Iterable[Recorded], now: datetime, grace_s: float | None
) -> RequestAccount:
    """Check one request stream (in order). A request admitted less than `grace_s` ago without
    its terminal event is in flight, not a finding (with `grace_s` None it is never a finding:
    the caller tells it); a stream that was never admitted (a refusal) has nothing to account
    for."""
    admitted_at: datetime | None = None
    batch_item = ""
    reserved = 0
    terminals: list[TerminalEvent] = []
    refunds: list[QuotaRefunded] = []
    bills: list[UsageBilled] = []
    for record in records:
        event = record.event
        if isinstance(event, RequestAdmitted):
            admitted_at = record.occurred_at
            batch_item = event.batch_item
        elif isinstance(event, RequestEstimated):
            reserved = event.reserved_tokens
        elif isinstance(event, _TERMINALS):
            terminals.append(event)  # type: ignore[arg-type]
        elif isinstance(event, QuotaRefunded):
            refunds.append(event)
        elif isinstance(event, UsageBilled):
            bills.append(event)
    findings: list[Finding] = []
    in_flight = False
    if admitted_at is not None and not terminals:
        if grace_s is None or now - admitted_at < timedelta(seconds=grace_s):
            in_flight = True
        else:
            findings.append(Finding("no_terminal", "admitted without a terminal event"))
    if len(terminals) > 1:
        findings.append(Finding("terminals", f"{len(terminals)} terminal events"))
    used = 0
    if terminals:
        end = terminals[0]
        # A preempted request used nothing of its quota (our decision); what a ledger entry
        # bills is `billed_counts`'s rule.
        counts = (end.prompt_tokens, end.completion_tokens, end.cached_tokens)
        used = 0 if isinstance(end, RequestPreempted) else counts[0] + counts[1]
        charged = billed_counts(TERMINAL_STATUS_OF[type(end)], batch_item, counts)
        if len(refunds) != 1:
            findings.append(Finding("refunds", f"{len(refunds)} refunds"))
        elif refunds[0].refunded_tokens != refund_due(reserved, used):
            findings.append(
                Finding(
                    "refund_mismatch",
                    f"refunded {refunds[0].refunded_tokens} tokens; reserved {reserved} − used "
                    f"{used} gives {refund_due(reserved, used)}",
                )
            )
        if len(bills) != 1:
            findings.append(Finding("bills", f"{len(bills)} UsageBilled events"))
        elif (
            bills[0].prompt_tokens, bills[0].completion_tokens, bills[0].cached_tokens
        ) != charged:
            findings.append(Finding("bill_mismatch", "billed tokens differ from the terminal's"))
    return RequestAccount(
        request_id=request_id,
        admitted_at=admitted_at,
        in_flight=in_flight,
        terminals=len(terminals),
        refunds=len(refunds),
        bills=len(bills),
        reserved_tokens=reserved,
        # The totals count a request's refund and bill only when there is exactly one of each:
        # the findings say what is wrong with the others.
        refunded_tokens=refunds[0].refunded_tokens if len(refunds) == 1 else 0,
        used_tokens=refunds[0].used_tokens if len(refunds) == 1 else 0,
        billed_tokens=bills[0].prompt_tokens + bills[0].completion_tokens if len(bills) == 1 else 0,
        findings=tuple(findings),
    )
