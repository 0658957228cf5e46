"""Finance and support services: who may read what, parameter parsing, and rendering of the
billing ledger, usage, invoices, reconciliation and request replays. Shared by the HTTP routes,
the web pages and the CLI, so every door applies the same rules."""

from __future__ import annotations

import csv
import io
import re
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa

from api.errors import ApiError
from domain.control import ControlView
from domain.events import LeasesRenewed, from_payload, parse_instant
from domain.replay import Timeline, replay
from ledger.finance import FinanceQueries, month_bounds
from ledger.schema import events
from ledger.store import EventStore

REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
GROUP_BY = ("hour", "day", "model", "key")
FORMATS = ("json", "csv")
MAX_RANGE = timedelta(days=366)
DEFAULT_RANGE = timedelta(days=30)
MAX_ENTRIES = 10_000

FINANCE_SCOPES = frozenset({"finance", "admin"})
SUPPORT_SCOPES = frozenset({"support", "admin"})


def parse_range(
    start_text: str | None, end_text: str | None, now: datetime
) -> tuple[datetime, datetime]:
    end = _instant(end_text, "to") if end_text else now
    start = _instant(start_text, "from") if start_text else end - DEFAULT_RANGE
    if start >= end:
        raise ApiError(400, "'from' must be before 'to'", param="from", code="invalid_range")
    if end - start > MAX_RANGE:
        raise ApiError(
            400, f"the range is longer than the {MAX_RANGE.days} days allowed", param="to",
            code="range_too_long",
        )
    return start, end


def _instant(text: str, param: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError:
        raise ApiError(
            400, f"'{param}' must be an ISO 8601 instant, e.g. 2026-11-01T00:00:00Z",
            param=param, code="invalid_value",
        ) from None
    return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def choice(value: str | None, allowed: tuple[str, ...], default: str, param: str) -> str:
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(
            400, f"'{param}' must be one of {', '.join(allowed)}", param=param, code="invalid_value"
        )
    return value


class Backoffice:
    def __init__(self, engine: sa.Engine, store: EventStore, control: ControlView) -> None:
        self.engine = engine
        self.store = store
        self.control = control
        self.finance = FinanceQueries(engine)

    # --- who may read which tenant -------------------------------------------------------------

    def billing_tenant(self, scope: str, own_tenant: str, requested: str | None) -> str | None:
        """The tenant a billing query is limited to (None: every tenant). Finance reads all; a
        customer only its own; anyone else is refused."""
        if scope in FINANCE_SCOPES:
            if requested is not None:
                self._known_tenant(requested)
            return requested
        if scope == "customer":
            if requested is not None and requested != own_tenant:
                raise ApiError(403, "a customer key reads only its own tenant's usage",
                               type="permission_error", param="tenant", code="forbidden")
            return own_tenant
        raise ApiError(403, f"a {scope} key may not read billing data",
                       type="permission_error", code="insufficient_scope")

    def _known_tenant(self, tenant: str) -> None:
        if self.control.tenant(tenant) is None:
            raise ApiError(404, f"unknown tenant {tenant!r}", param="tenant",
                           code="tenant_not_found")

    # --- finance -------------------------------------------------------------------------------

    def usage(self, tenant: str | None, start: datetime, end: datetime, model: str | None,
              group_by: str) -> list[dict[str, Any]]:
        return self.finance.usage(tenant, start, end, model, group_by)

    def entries(self, tenant: str | None, start: datetime, end: datetime, model: str | None,
                limit: int, after: str | None) -> list[dict[str, Any]]:
        if not 1 <= limit <= MAX_ENTRIES:
            raise ApiError(400, f"'limit' must be within 1..{MAX_ENTRIES}", param="limit",
                           code="invalid_value")
        return self.finance.entries(tenant, start, end, model, limit, after)

    def invoice(self, tenant: str, period: str | None, now: datetime) -> dict[str, Any]:
        self._known_tenant(tenant)
        period = period or now.strftime("%Y-%m")
        try:
            month_bounds(period)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="period", code="invalid_value") from None
        return self.finance.invoice(tenant, period)

    def reconciliation(self, start: datetime, end: datetime) -> dict[str, Any]:
        return self.finance.reconciliation(start, end)

    # --- support -------------------------------------------------------------------------------

    def timeline(self, request_id: str, scope: str, own_tenant: str, now: datetime) -> Timeline:
        """Re-fold a request's stored events. Another tenant's request answers exactly like an
        unknown one (404), so ids cannot be probed across tenants."""
        if not REQUEST_ID.match(request_id):
            raise ApiError(400, "request ids look like req_ followed by 32 hex digits",
                           param="request_id", code="invalid_value")
        records = self.store.read_stream(request_id)
        visible = bool(records) and (
            scope in SUPPORT_SCOPES or (scope == "customer" and records[0].tenant_id == own_tenant)
        )
        if scope not in SUPPORT_SCOPES and scope != "customer":
            raise ApiError(403, f"a {scope} key may not read request timelines",
                           type="permission_error", code="insufficient_scope")
        if not visible:
            raise ApiError(404, f"no request {request_id}", param="request_id",
                           code="request_not_found")
        renewals = self._renewals(records)
        return replay(request_id, records, self.control, now, renewals)

    def _renewals(self, records: list[Any]) -> tuple[Any, ...]:
        edge_id = getattr(records[0].event, "edge_id", None)
        if not edge_id:
            return ()
        lo, hi = records[0].position, records[-1].position
        e = events
        query = (
            sa.select(e.c.position, e.c.occurred_at, e.c.payload)
            .where(e.c.stream_id == f"edge-{edge_id}", e.c.position > lo, e.c.position < hi)
            .order_by(e.c.position)
        )
        out = []
        with self.engine.connect() as conn:
            for position, occurred_at, payload in conn.execute(query):
                event = from_payload("LeasesRenewed", 1, orjson.loads(payload))
                assert isinstance(event, LeasesRenewed)
                out.append(_Renewal(position, occurred_at, event))
        return tuple(out)


class _Renewal:
    """The slice of a Recorded the replay reads for lease renewals."""

    __slots__ = ("position", "occurred_at", "event")

    def __init__(self, position: int, occurred_at: datetime, event: LeasesRenewed) -> None:
        self.position = position
        self.occurred_at = occurred_at
        self.event = event


# --- rendering ---------------------------------------------------------------------------------


def timeline_json(t: Timeline) -> dict[str, Any]:
    state = t.state
    return {
        "request_id": t.request_id,
        "status": state.status,
        "tenant": state.tenant_id or None,
        "key_id": state.key_id or None,
        "model": state.model or None,
        "tier": state.tier or None,
        "plan_at_admission": t.plan_at_admission,
        "limits_at_admission": t.limits_at_admission,
        "replica_id": t.replica_id,
        "replica_occupancy_at_routing": (
            None if t.occupancy_ppm_at_routing is None else t.occupancy_ppm_at_routing / 1e6
        ),
        "ttft_ms": t.ttft_ms,
        "tpot_us": t.tpot_us,
        "quota": {
            "reserved_tokens": t.reserved_tokens,
            "refunded_tokens": t.refunded_tokens,
            "used_tokens": t.used_tokens,
        },
        "tokens": {
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
        },
        "billing": t.bill,
        "rejection": t.reject,
        "lease_renewals": t.lease_renewals,
        "events": [
            {
                "position": s.position,
                "stream_version": s.stream_version,
                "occurred_at": _iso(s.occurred_at),
                "type": s.type,
                "state_after": s.status_after,
                "quota_effect": s.quota_effect,
                "payload": s.payload,
                **({"note": s.note} if s.note else {}),
            }
            for s in t.steps
        ],
        "anomalies": [asdict(a) if is_dataclass(a) else a for a in t.anomalies],
    }


def to_csv(rows: list[dict[str, Any]], columns: tuple[str, ...] | None = None) -> str:
    out = io.StringIO()
    names = list(columns or (rows[0].keys() if rows else ()))
    writer = csv.DictWriter(out, fieldnames=names, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


USAGE_COLUMNS = ("tenant", "model", "period_start", "requests", "prompt_tokens",
                 "completion_tokens", "cached_tokens", "amount_micros")
ENTRY_COLUMNS = ("request_id", "tenant", "key_id", "model", "prompt_tokens", "completion_tokens",
                 "cached_tokens", "prompt_micros_per_mtok", "completion_micros_per_mtok",
                 "cached_micros_per_mtok", "amount_micros", "terminal_reason", "admitted_at",
                 "finished_at", "billed_at")
INVOICE_COLUMNS = ("model", "prompt_micros_per_mtok", "completion_micros_per_mtok",
                   "cached_micros_per_mtok", "requests", "uncached_prompt_tokens",
                   "cached_tokens", "completion_tokens", "amount_micros")


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def instant(text: str) -> datetime:
    return parse_instant(text)
