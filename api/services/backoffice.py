"""Finance and support services: who may read what, parameter parsing, and rendering of the
billing ledger, usage, invoices, reconciliation and request replays. Shared by the HTTP routes,
the web pages and the CLI, so every door applies the same rules."""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.governance.state import Budget, month_start
from tollgate_llm.domain.leases import edge_stream
from tollgate_llm.domain.projections import REQUEST_LOG_STATUSES
from tollgate_llm.domain.replay import Timeline, replay
from tollgate_llm.domain.text import unstorable
from tollgate_llm.ledger.finance import FinanceQueries, currency_totals, month_bounds
from tollgate_llm.ledger.store import EventStore

REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
GROUP_BY = (
    "hour", "day", "model", "key", "workspace", "project", "run", "region", "adapter", "end_user",
)
FORMATS = ("json", "csv")
MAX_RANGE = timedelta(days=366)
DEFAULT_RANGE = timedelta(days=30)
MAX_ENTRIES = 10_000
# A page of a tenant's requests (support): 50 unless asked, at most 500.
REQUESTS_LIMIT_DEFAULT = 50
REQUESTS_LIMIT_MAX = 500

FINANCE_SCOPES = frozenset({"finance", "admin"})
SUPPORT_SCOPES = frozenset({"support", "admin"})


def parse_range(
    start_text: str | None, end_text: str | None, now: datetime
) -> tuple[datetime, datetime]:
    end = _instant(end_text, "to") if end_text else now
    if start_text:
        start = _instant(start_text, "from")
    elif end - datetime.min.replace(tzinfo=UTC) < DEFAULT_RANGE:  # end - DEFAULT_RANGE overflows
        raise ApiError(400, "'to' is too early for the default 30-day range: give 'from' too",
                       param="to", code="invalid_range")
    else:
        start = end - DEFAULT_RANGE
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
        # Year 1 with a positive offset (or 9999 with a negative one) is out of range in UTC.
        return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ApiError(
            400, f"'{param}' must be an ISO 8601 instant, e.g. 2026-11-01T00:00:00Z",
            param=param, code="invalid_value",
        ) from None


def groups(value: str | None, allowed: tuple[str, ...], default: tuple[str, ...],
           param: str) -> tuple[str, ...]:
    """A comma-separated subset of `allowed`, in the order given (default when absent)."""
    if value is None:
        return default
    parts = value.split(",")
    chosen = tuple(dict.fromkeys(parts))
    if any(v not in allowed for v in parts):
        raise ApiError(
            400, f"'{param}' must be a comma-separated subset of {', '.join(allowed)}",
            param=param, code="invalid_value",
        )
    return chosen


def choice(value: str | None, allowed: tuple[str, ...], default: str, param: str) -> str:
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(
            400, f"'{param}' must be one of {', '.join(allowed)}", param=param, code="invalid_value"
        )
    return value


def _queryable(value: str | None, param: str) -> None:
    """A filter compared with stored text: one PostgreSQL could not even take as a parameter (a
    NUL) matches nothing there and failed as a 500; it is a 400 naming it on every backend."""
    reason = None if value is None else unstorable(value)
    if reason is not None:
        raise ApiError(400, f"'{param}' {reason}", param=param, code="invalid_value")


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

    def requests_tenant(self, scope: str, own_tenant: str, requested: str | None) -> str:
        """The one tenant a request listing reads. Support, admin and finance name it; a customer
        reads its own, and naming another answers exactly like an unknown tenant (404), so
        tenant names cannot be probed any more than request ids can (`timeline`)."""
        if scope in SUPPORT_SCOPES or scope in FINANCE_SCOPES:
            if not requested:
                raise ApiError(400, f"a {scope} key lists one tenant's requests: give 'tenant'",
                               param="tenant", code="missing_required_parameter")
            self._known_tenant(requested)
            return requested
        if scope == "customer":
            if requested and requested != own_tenant:
                raise _unknown_tenant(requested)
            return own_tenant
        raise ApiError(403, f"a {scope} key may not list requests",
                       type="permission_error", code="insufficient_scope")

    def _known_tenant(self, tenant: str) -> None:
        if self.control.tenant(tenant) is None:
            raise _unknown_tenant(tenant)

    # --- finance -------------------------------------------------------------------------------

    def usage(self, tenant: str | None, start: datetime, end: datetime, model: str | None,
              group_by: str) -> list[dict[str, Any]]:
        _queryable(model, "model")
        return self.finance.usage(tenant, start, end, model, group_by)

    def entries(self, tenant: str | None, start: datetime, end: datetime, model: str | None,
                limit: int, after: str | None) -> list[dict[str, Any]]:
        if not 1 <= limit <= MAX_ENTRIES:
            raise ApiError(400, f"'limit' must be within 1..{MAX_ENTRIES}", param="limit",
                           code="invalid_value")
        _queryable(model, "model")
        _queryable(after, "after")
        return self.finance.entries(tenant, start, end, model, limit, after)

    def flex(self, tenant: str | None, start: datetime, end: datetime) -> list[dict[str, Any]]:
        return self.finance.flex(tenant, start, end)

    def goodput(self, tenant: str | None, start: datetime, end: datetime,
                group_by: tuple[str, ...]) -> list[dict[str, Any]]:
        return self.finance.goodput(tenant, start, end, group_by, self.control.slo)

    def spend_tree(self, tenant: str, now: datetime) -> dict[str, Any]:
        """A tenant's hierarchy as rows (depth, level, name, this month's spend per currency,
        its monthly and daily budgets, each with its currency), organization first, each
        workspace with its projects and keys under it: the finance page's tree and
        `tollgate budgets show`. The month is the organization's (its time zone). `used_ppm`:
        the monthly budget's share spent, counting the spend in its currency only (the only
        spend it counts)."""
        self._known_tenant(tenant)
        tree = self.control.hierarchy
        zone_name = tree.time_zone_name(tenant)
        start = month_start(now, zone_name)
        spent: dict[tuple[str, str | None], dict[str, int]] = defaultdict(dict)
        for workspace, project, key, currency, amount in self.finance.spend_by_level(
            tenant, start
        ):
            for level in (("org", tenant), ("workspace", workspace), ("project", project),
                          ("key", key)):  # fmt: skip
                if level[1] is not None:
                    spent[level][currency] = spent[level].get(currency, 0) + amount

        def row(depth: int, kind: str, level_id: str, name: str) -> dict[str, Any]:
            budgets = tree.level_budgets(tenant, kind, level_id)
            here = spent.get((kind, level_id), {})
            month = budgets.get("month")
            used_ppm = None
            if month is not None and month.amount_micros:
                used_ppm = here.get(month.currency, 0) * 1_000_000 // month.amount_micros
            return {"depth": depth, "level": kind, "name": name, "spent": _amounts(here),
                    "month_budget": _budget(month), "day_budget": _budget(budgets.get("day")),
                    "used_ppm": used_ppm}  # fmt: skip

        keys_of: dict[str | None, list[str]] = defaultdict(list)
        for key in self.control.keys(tenant):
            if key.scope == "customer" and not key.revoked:
                keys_of[tree.project_of_key(tenant, key.key_id)].append(key.key_id)
        rows = [row(0, "org", tenant, tenant)]
        projects = tree.projects(tenant)
        for workspace in tree.workspaces(tenant):
            rows.append(row(1, "workspace", workspace.level_id, workspace.name))
            for project, parent in projects:
                if parent == workspace.level_id:
                    rows.append(row(2, "project", project.level_id, project.name))
                    rows += [row(3, "key", k, k) for k in keys_of.get(project.level_id, ())]
        rows += [row(1, "key", k, k) for k in keys_of.get(None, ())]
        return {"tenant": tenant, "time_zone": zone_name, "month_start": _iso(start),
                "levels": rows}  # fmt: skip

    def invoice(self, tenant: str, period: str | None, now: datetime) -> dict[str, Any]:
        self._known_tenant(tenant)
        period = period or now.strftime("%Y-%m")
        try:
            month_bounds(period)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="period", code="invalid_value") from None
        return self.finance.invoice(tenant, period)

    def reconciliation(self, start: datetime, end: datetime) -> dict[str, Any]:
        return self.finance.reconciliation(self.store, start, end)

    # --- support -------------------------------------------------------------------------------

    def timeline(self, request_id: str, scope: str, own_tenant: str, now: datetime) -> Timeline:
        """Re-fold a request's stored events. Another tenant's request answers exactly like an
        unknown one (404), so ids cannot be probed across tenants."""
        if not REQUEST_ID.fullmatch(request_id):
            raise ApiError(400, "request ids look like req_ followed by 32 hex digits",
                           param="request_id", code="invalid_value")
        if scope not in SUPPORT_SCOPES and scope != "customer":
            raise ApiError(403, f"a {scope} key may not read request timelines",
                           type="permission_error", code="insufficient_scope")
        # A customer reads its own tenant's events only, filtered in the one query: another
        # tenant's request costs the same as an unknown one (nothing decoded, nothing folded).
        records = self.store.read_stream(
            request_id, None if scope in SUPPORT_SCOPES else own_tenant
        )
        if not records:
            raise ApiError(404, f"no request {request_id}", param="request_id",
                           code="request_not_found")
        renewals = self._renewals(records)
        return replay(request_id, records, self.control, now, renewals)

    def requests(self, tenant: str, start: datetime, end: datetime, *, status: str | None,
                 key_id: str | None, model: str | None, limit: int,
                 after: str | None) -> dict[str, Any]:
        """A page of the tenant's requests, newest first: `after` is the `last_id` of the page
        before (a request of this tenant, else a 400 naming it). Rows from the request log: ids,
        states, tokens and instants, never a prompt or a completion (it holds none)."""
        if not 1 <= limit <= REQUESTS_LIMIT_MAX:
            raise ApiError(400, f"'limit' must be within 1..{REQUESTS_LIMIT_MAX}", param="limit",
                           code="invalid_value")
        if status is not None and status not in REQUEST_LOG_STATUSES:
            raise ApiError(400, f"'status' must be one of {', '.join(REQUEST_LOG_STATUSES)}",
                           param="status", code="invalid_value")
        for value, param in ((key_id, "key_id"), (model, "model"), (after, "after")):
            _queryable(value, param)
        anchor = None
        if after is not None:
            at = self.finance.request_admitted_at(tenant, after)
            if at is None:
                raise ApiError(400, f"'after' names no request of tenant {tenant!r}",
                               param="after", code="invalid_value")
            anchor = (at, after)
        # One row more than asked says whether another page follows.
        rows = self.finance.requests(tenant, start, end, status=status, key_id=key_id,
                                     model=model, limit=limit + 1, after=anchor)
        page = rows[:limit]
        return {"object": "list", "tenant": tenant, "data": page,
                "has_more": len(rows) > limit,
                "last_id": page[-1]["request_id"] if page else None}  # fmt: skip

    def _renewals(self, records: list[Recorded]) -> tuple[Recorded, ...]:
        """The renewals the request's edge appended while the request was open."""
        edge_id = getattr(records[0].event, "edge_id", None)
        if not edge_id:
            return ()
        lo, hi = records[0].position, records[-1].position
        return tuple(self.store.read_stream_window(edge_stream(edge_id), lo, hi))


def _unknown_tenant(tenant: str) -> ApiError:
    return ApiError(404, f"unknown tenant {tenant!r}", param="tenant", code="tenant_not_found")


# --- rendering ---------------------------------------------------------------------------------


def _retention_of(t: Timeline) -> str | None:
    """The tier recorded on its admission (a replay without the control view still says it)."""
    admitted = next((s.payload for s in t.steps if s.type == "RequestAdmitted"), None)
    return None if admitted is None else admitted.get("retention") or "standard"


def timeline_json(t: Timeline) -> dict[str, Any]:
    state = t.state
    return {
        "request_id": t.request_id,
        "status": state.status,
        "tenant": state.tenant_id or None,
        "key_id": state.key_id or None,
        "model": state.model or None,
        # The tenant's LoRA adapter of `model` that served it (tollgate adapters register).
        "adapter": state.adapter or None,
        # The end user it named, as the tenant's keyed hash (never the identifier).
        "end_user": state.end_user or None,
        "tier": state.tier or None,
        # The edge's trace of it (OpenTelemetry, when tracing was on), from its admission.
        "trace_id": next(
            (s.payload.get("trace_id") or None for s in t.steps if s.type == "RequestAdmitted"),
            None,
        ),
        "downgraded_from": state.downgraded_from,
        # The router's choice of its model (tollgate routing allow), and the customer's score.
        "routing": next((s.payload for s in t.steps if s.type == "RequestModelRouted"), None),
        "feedback": None if state.feedback_score_ppm is None else {
            "score": state.feedback_score_ppm / 1_000_000, "label": state.feedback_label or None,
        },
        # Its place in the tenant's hierarchy and its agent run (None: the organization's key,
        # no run); a refusal by a level names it, and its state then, in `rejection`.
        "workspace": state.workspace_id,
        "project": state.project_id,
        "run": state.run_id,
        "budget_reserved_micros": state.reserved_micros or None,
        "budget_reserved_currency": state.reserved_currency or None,
        "plan_at_admission": t.plan_at_admission,
        "limits_at_admission": t.limits_at_admission,
        "replica_id": t.replica_id,
        "replica_occupancy_at_routing": (
            None if t.occupancy_ppm_at_routing is None else t.occupancy_ppm_at_routing / 1e6
        ),
        # Where it ran (the replica's region) and what was kept of it (its retention tier).
        "region": t.region or None,
        "retention": t.retention or _retention_of(t),
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


# Every amount beside its currency (ISO 4217), in the CSV exports and the CLI's tables alike.
USAGE_COLUMNS = ("tenant", "model", "period_start", "requests", "prompt_tokens",
                 "completion_tokens", "cached_tokens", "amount_micros", "currency")
# The column a usage row grouped by one of these adds (finance reads them from the ledger).
GROUP_COLUMNS = {"key": "key_id", "workspace": "workspace_id", "project": "project_id",
                 "run": "run_id", "region": "region", "adapter": "adapter",
                 "end_user": "end_user"}  # fmt: skip
ENTRY_COLUMNS = ("request_id", "tenant", "key_id", "model", "prompt_tokens", "completion_tokens",
                 "cached_tokens", "prompt_micros_per_mtok", "completion_micros_per_mtok",
                 "cached_micros_per_mtok", "amount_micros", "currency", "terminal_reason",
                 "admitted_at",
                 "finished_at", "billed_at", "workspace_id", "project_id", "run_id", "adapter")
INVOICE_COLUMNS = ("model", "adapter", "prompt_micros_per_mtok", "completion_micros_per_mtok",
                   "cached_micros_per_mtok", "requests", "uncached_prompt_tokens",
                   "cached_tokens", "completion_tokens", "amount_micros", "currency")


def _amounts(by_currency: dict[str, int]) -> list[dict[str, Any]]:
    """{currency: micro-units} as the amounts every billing object shows, in currency order."""
    return [
        {"currency": t["currency"], "amount_micros": t["amount_micros"], "amount": t["amount"]}
        for t in currency_totals(
            [{"currency": c, "requests": 0, "amount_micros": a} for c, a in by_currency.items()]
        )
    ]


def _budget(budget: Budget | None) -> dict[str, Any] | None:
    """A budget as the spend tree shows it: its amount with its currency."""
    if budget is None:
        return None
    return _amounts({budget.currency: budget.amount_micros})[0]


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")

