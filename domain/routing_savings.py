"""What the router saved, and the quality it cost, per tenant and month, from the log alone:
each routed request's bill (the serving model's price, as billed) against what the same engine
counts would have cost at the reference model's price in force at its admission, beside the
customers' mean score of the routed-away requests and of those served by the reference."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from tollgate_llm.domain.cost import Price, amount_micros
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted, UsageBilled

__all__ = ["SavingsRow", "savings"]

# (model, admitted at, service tier) -> the price in force (ControlView.price)
PriceOf = Callable[[str, datetime, str], Price]


@dataclass
class SavingsRow:
    tenant_id: str
    month: str  # "2026-05", of the bill's finished_at (as usage is bucketed)
    currency: str
    routed_requests: int = 0  # auto requests billed
    routed_away: int = 0  # ... served by a cheaper model than the reference
    billed_micros: int = 0  # what they were billed
    reference_micros: int = 0  # what the reference model would have billed for the same counts
    # Customers' scores (client feedback only), ppm sums and counts: routed away / reference.
    score_routed_away_ppm: int = 0
    scored_routed_away: int = 0
    score_reference_ppm: int = 0
    scored_reference: int = 0

    @property
    def saving_micros(self) -> int:
        return self.reference_micros - self.billed_micros


def savings(streams: Iterable[list[Recorded]], price_of: PriceOf) -> list[SavingsRow]:
    """One row per (tenant, month, currency) over the request streams given (those with a
    RequestModelRouted); a stream not billed yet counts nothing."""
    rows: dict[tuple[str, str, str], SavingsRow] = {}
    for records in streams:
        events = [r.event for r in records]
        routed = next((e for e in events if isinstance(e, RequestModelRouted)), None)
        bill = next((e for e in events if isinstance(e, UsageBilled)), None)
        if routed is None or bill is None:
            continue
        month = bill.finished_at.strftime("%Y-%m")
        row = rows.setdefault(
            (bill.tenant_id, month, bill.currency), SavingsRow(bill.tenant_id, month, bill.currency)
        )
        reference = price_of(routed.reference_model, bill.admitted_at, bill.service_tier)
        row.routed_requests += 1
        row.billed_micros += bill.amount_micros
        row.reference_micros += amount_micros(
            reference, bill.prompt_tokens, bill.completion_tokens, bill.cached_tokens
        )
        away = routed.served_model != routed.reference_model
        row.routed_away += away
        for event in events:
            if isinstance(event, FeedbackRecorded) and event.source == "client":
                if away:
                    row.score_routed_away_ppm += event.score_ppm
                    row.scored_routed_away += 1
                else:
                    row.score_reference_ppm += event.score_ppm
                    row.scored_reference += 1
    return sorted(rows.values(), key=lambda r: (r.tenant_id, r.month, r.currency))
