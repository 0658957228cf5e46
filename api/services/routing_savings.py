"""What the router saved per tenant and month (`domain.routing_savings` over the routed requests'
streams): for finance's `tollgate routing savings` and `GET /v1/routing/savings` alike. The
streams are found by their RequestModelRouted, in the tenant asked for only."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.requests.events import RequestModelRouted
from tollgate_llm.domain.routing_savings import savings
from tollgate_llm.ledger.store import EventStore

__all__ = ["SAVINGS_COLUMNS", "routing_savings"]

SAVINGS_COLUMNS = (
    "tenant", "month", "currency", "routed_requests", "routed_away", "billed_micros",
    "reference_micros", "saving_micros", "mean_score_routed_away", "mean_score_reference",
)  # fmt: skip


def routing_savings(
    store: EventStore, control: ControlView, tenant: str | None, month: str
) -> list[dict[str, Any]]:
    """One row per (tenant, month, currency) of `month` ("YYYY-MM", UTC; the bill's month);
    `tenant` None: every tenant (a finance reader)."""
    try:
        start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    except ValueError:
        raise ApiError(
            400, "'month' must be YYYY-MM", param="month", code="invalid_value"
        ) from None
    end = (start + timedelta(days=32)).replace(day=1)
    # A request admitted in the month's last seconds may be billed in the next one: its
    # RequestModelRouted is looked up a day either side, and the bill's month decides.
    ids = store.streams_with(
        RequestModelRouted.EVENT_TYPE, start - timedelta(days=1), end + timedelta(days=1),
        tenant_id=tenant,
    )  # fmt: skip
    streams = store.read_streams(ids).values() if ids else []
    rows = []
    for r in savings(streams, control.price):
        if r.month != month or (tenant is not None and r.tenant_id != tenant):
            continue
        rows.append({
            "tenant": r.tenant_id, "month": r.month, "currency": r.currency,
            "routed_requests": r.routed_requests, "routed_away": r.routed_away,
            "billed_micros": r.billed_micros, "reference_micros": r.reference_micros,
            "saving_micros": r.saving_micros,
            "mean_score_routed_away": _mean(r.score_routed_away_ppm, r.scored_routed_away),
            "mean_score_reference": _mean(r.score_reference_ppm, r.scored_reference),
        })  # fmt: skip
    return rows


def _mean(total_ppm: int, count: int) -> float | None:
    return round(total_ppm / count / 1_000_000, 6) if count else None
