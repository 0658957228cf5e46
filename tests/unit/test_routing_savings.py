"""Finance's view of the router (issue 32 item 3): a routed request's bill against what the
reference model's price in force at its admission would have billed for the same engine counts,
per tenant and month, with the customers' scores on each side."""

from __future__ import annotations

from datetime import datetime

from tests import builders as b
from tollgate_llm.domain.cost import Price, amount_micros
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted
from tollgate_llm.domain.routing_savings import savings

SMALL, LARGE = "llama-3.1-8b-2026-05", "llama-3.1-70b-2026-05"
PRICES = {SMALL: Price(SMALL, 200_000, 600_000, 50_000), LARGE: Price(LARGE, 2_000_000, 6_000_000,
                                                                      500_000)}  # fmt: skip


def price_of(model: str, at: datetime, service_tier: str) -> Price:
    return PRICES[model]


def routed_request(
    rid: str, served: str, score_ppm: int | None = None, billed: bool = True
) -> list[Recorded]:
    events: list[Event] = [
        b.admitted(request_id=rid, model=served),
        RequestModelRouted(rid, "auto", LARGE, served, "c", 900_000, 800_000, "meets_bar"),
    ]
    if billed:
        amount = amount_micros(PRICES[served], 812, 300, 512)
        events.append(b.billed(request_id=rid, model=served, amount_micros=amount))
    if score_ppm is not None:
        events.append(FeedbackRecorded(rid, b.TENANT, served, "c", score_ppm, "client"))
    return b.stream(*events)


def test_the_saving_is_the_reference_price_of_the_same_counts_less_the_bill() -> None:
    (row,) = savings(
        [routed_request("a", SMALL, 900_000), routed_request("b", LARGE, 700_000),
         routed_request("c", SMALL, billed=False)],
        price_of,
    )  # fmt: skip
    small, large = (
        amount_micros(PRICES[SMALL], 812, 300, 512),
        amount_micros(PRICES[LARGE], 812, 300, 512),
    )
    assert (row.routed_requests, row.routed_away) == (2, 1)  # the unbilled one counts nothing
    assert row.billed_micros == small + large
    assert row.reference_micros == 2 * large
    assert row.saving_micros == large - small > 0
    assert (row.score_routed_away_ppm, row.scored_routed_away) == (900_000, 1)
    assert (row.score_reference_ppm, row.scored_reference) == (700_000, 1)
    assert row.month == b.billed().finished_at.strftime("%Y-%m")
