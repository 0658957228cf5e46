"""Finance queries over the billing projections: ledger entries, usage, invoices, and the
reconciliation report that checks the projections against the events.

Every query takes explicit UTC bounds [start, end) and, where it applies, a tenant; callers
(the API, the CLI) decide what a caller may see. Money is integer micro-units throughout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tollgate_llm.domain.goodput import OUTCOMES, Attainment, Slo, outcome
from tollgate_llm.domain.reconcile import account
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.schema import ledger_entries, request_log, usage_hourly
from tollgate_llm.ledger.store import EventStore

USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")


def month_bounds(period: str) -> tuple[datetime, datetime]:
    """'2026-11' -> [2026-11-01, 2026-12-01) in UTC. Raises ValueError for anything else."""
    year_text, sep, month_text = period.partition("-")
    if not sep or len(year_text) != 4 or len(month_text) != 2:
        raise ValueError(f"period {period!r} is not YYYY-MM")
    year, month = int(year_text), int(month_text)
    if not 1 <= month <= 12:
        raise ValueError(f"period {period!r} has no month {month}")
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _model_filter(column: Any, model: str | None) -> Any:
    """A model filter matches the exact version or, given a base name, all its versions."""
    if model is None:
        return sa.true()
    return sa.or_(column == model, column.like(model.replace("%", r"\%") + "-%"))


# usage group_by values read from the ledger entries (not the hourly rollup), and their column.
ENTRY_GROUPS: Final = {
    "key": "key_id", "workspace": "workspace_id", "project": "project_id", "run": "run_id",
    "adapter": "adapter", "end_user": "end_user",
}  # fmt: skip
# usage group_by values read from the request log joined to the entries (where a request ran).
LOG_GROUPS: Final = {"region": "region"}


@dataclass(frozen=True)
class FinanceQueries:
    engine: Engine

    def flex(self, tenant: str | None, start: datetime, end: datetime) -> list[dict[str, Any]]:
        """Per model, over requests that ended in [start, end): the flex class's billed requests
        and revenue (`flex_amounts`: per currency), and the preemption waste (requests
        preempted, the tokens the engine had done for them, never billed). The finance views
        `finance_flex_revenue` and `finance_preemption_waste` give the same per day."""
        e, r = ledger_entries, request_log
        billed = sa.select(
            e.c.model, e.c.currency, sa.func.count().label("n"),
            sa.func.sum(e.c.amount_micros).label("amount"),
        ).where(
            e.c.service_tier == "flex", e.c.finished_at >= start, e.c.finished_at < end,
            e.c.terminal != "preempted", *([e.c.tenant_id == tenant] if tenant else []),
        ).group_by(e.c.model, e.c.currency)
        wasted = sa.select(
            r.c.model, sa.func.count().label("n"),
            sa.func.sum(r.c.prompt_tokens).label("prompt"),
            sa.func.sum(r.c.completion_tokens).label("completion"),
        ).where(
            r.c.status == "preempted", r.c.finished_at >= start, r.c.finished_at < end,
            *([r.c.tenant_id == tenant] if tenant else []),
        ).group_by(r.c.model)
        rows: dict[str, dict[str, Any]] = {}

        def row(model: str) -> dict[str, Any]:
            return rows.setdefault(model, {
                "model": model, "flex_requests": 0, "flex_amounts": [],
                "preempted_requests": 0, "wasted_prompt_tokens": 0,
                "wasted_completion_tokens": 0,
            })

        with self.engine.connect() as conn:
            for model, currency, n, amount in conn.execute(billed):
                line = row(model)
                line["flex_requests"] += int(n)
                line["flex_amounts"] = currency_totals([
                    *line["flex_amounts"],
                    {"currency": currency, "requests": int(n), "amount_micros": int(amount or 0)},
                ])
            for model, n, prompt, completion in conn.execute(wasted):
                row(model).update(preempted_requests=int(n), wasted_prompt_tokens=int(prompt or 0),
                                  wasted_completion_tokens=int(completion or 0))
        return [rows[m] for m in sorted(rows)]

    def usage(
        self,
        tenant: str | None,
        start: datetime,
        end: datetime,
        model: str | None,
        group_by: str,
    ) -> list[dict[str, Any]]:
        """Usage rows (tenant, model, period_start, currency, requests, tokens, amount_micros)
        grouped by hour, day, model (one row per tenant and model over the range) or key (from
        entries); always per currency too, so no row sums two currencies."""
        if group_by in ENTRY_GROUPS:
            return self._usage_by(ENTRY_GROUPS[group_by], tenant, start, end, model)
        if group_by in LOG_GROUPS:
            return self._usage_by(LOG_GROUPS[group_by], tenant, start, end, model, logged=True)
        u = usage_hourly
        hour: Any = u.c.hour
        if group_by == "hour" and self.engine.dialect.name == "postgresql":
            # The hot finance read: PostgreSQL formats the instant, Python does no datetime work.
            hour = sa.func.to_char(
                sa.func.timezone("UTC", u.c.hour), 'YYYY-MM-DD"T"HH24:MI:SS"Z"'
            )
        query = (
            sa.select(
                u.c.tenant_id, u.c.model, hour, u.c.currency, *(u.c[f] for f in USAGE_FIELDS)
            )
            .where(u.c.hour >= start, u.c.hour < end, _model_filter(u.c.model, model))
            .order_by(u.c.hour, u.c.tenant_id, u.c.model, u.c.currency)
        )
        if tenant is not None:
            query = query.where(u.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        if group_by == "hour":
            # The hot finance read (30 days of a big tenant is thousands of rows): rows are
            # built by zip, instants formatted directly (they are UTC whole hours).
            names = ("tenant", "model", "period_start", "currency", *USAGE_FIELDS)
            return [
                dict(
                    zip(
                        names,
                        (r[0], r[1], _hour_text(r[2]), r[3], *map(int, r[4:])),
                        strict=True,
                    )
                )
                for r in rows
            ]
        buckets: dict[tuple[str, str, datetime, str], dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(USAGE_FIELDS, 0)
        )
        for r in rows:
            if group_by == "day":
                when = r[2].replace(hour=0, minute=0, second=0, microsecond=0)
            else:  # model
                when = start
            bucket = buckets[(r.tenant_id, r.model, when, r.currency)]
            for f in USAGE_FIELDS:
                bucket[f] += getattr(r, f)
        return [
            {"tenant": t, "model": m, "period_start": _iso(when), "currency": c, **values}
            for (t, m, when, c), values in sorted(
                buckets.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1], kv[0][3])
            )
        ]

    def _usage_by(
        self, column: str, tenant: str | None, start: datetime, end: datetime, model: str | None,
        *, logged: bool = False,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Usage per tenant, model and one column of the ledger (a key, or a level of the
        hierarchy: workspace, project, run; null for what is the organization's own), or with
        `logged` of the request log (the region a request ran in: "" for none given, null for
        a request recorded before regions)."""
        e = ledger_entries
        by = request_log.c[column] if logged else e.c[column]
        query = (
            sa.select(
                e.c.tenant_id,
                by.label("by"),
                e.c.model,
                e.c.currency,
                sa.func.count().label("requests"),
                sa.func.sum(e.c.prompt_tokens).label("prompt_tokens"),
                sa.func.sum(e.c.completion_tokens).label("completion_tokens"),
                sa.func.sum(e.c.cached_tokens).label("cached_tokens"),
                sa.func.sum(e.c.amount_micros).label("amount_micros"),
            )
            .select_from(
                e.join(request_log, request_log.c.request_id == e.c.request_id) if logged else e
            )
            .where(e.c.finished_at >= start, e.c.finished_at < end, _model_filter(e.c.model, model))
            .group_by(e.c.tenant_id, by, e.c.model, e.c.currency)
            .order_by(e.c.tenant_id, by, e.c.model, e.c.currency)
        )
        if tenant is not None:
            query = query.where(e.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            {**_usage_row(r.tenant_id, r.model, start, r), "currency": r.currency, column: r.by}
            for r in rows
        ]

    def spend_by_level(
        self, tenant: str, since: datetime
    ) -> list[tuple[str | None, str | None, str, str, int]]:
        """(workspace, project, key, currency, amount_micros) of a tenant's requests admitted
        since `since`: what its budgets count this period (a request counts where it was
        admitted; a budget, only in its own currency)."""
        e = ledger_entries
        query = (
            sa.select(e.c.workspace_id, e.c.project_id, e.c.key_id, e.c.currency,
                      sa.func.sum(e.c.amount_micros))  # fmt: skip
            .where(e.c.tenant_id == tenant, e.c.admitted_at >= since)
            .group_by(e.c.workspace_id, e.c.project_id, e.c.key_id, e.c.currency)
        )
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2], r[3], int(r[4] or 0)) for r in conn.execute(query)]

    def entries(
        self,
        tenant: str | None,
        start: datetime,
        end: datetime,
        model: str | None,
        limit: int,
        after: str | None = None,
    ) -> list[dict[str, Any]]:
        """Ledger entries in (finished_at, request_id) order; `after` is the last request id of
        the previous page."""
        e = ledger_entries
        query = (
            sa.select(e)
            .where(e.c.finished_at >= start, e.c.finished_at < end, _model_filter(e.c.model, model))
            .order_by(e.c.finished_at, e.c.request_id)
            .limit(limit)
        )
        if tenant is not None:
            query = query.where(e.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            if after is not None:
                anchor = conn.execute(
                    sa.select(e.c.finished_at).where(e.c.request_id == after)
                ).scalar()
                if anchor is not None:
                    query = query.where(
                        sa.or_(
                            e.c.finished_at > anchor,
                            sa.and_(e.c.finished_at == anchor, e.c.request_id > after),
                        )
                    )
            rows = conn.execute(query).mappings().all()
        return [_entry({str(k): v for k, v in r.items()}) for r in rows]

    @faults.seam("db.read")
    def requests(
        self,
        tenant: str,
        start: datetime,
        end: datetime,
        *,
        status: str | None = None,
        key_id: str | None = None,
        model: str | None = None,
        limit: int = 50,
        after: tuple[datetime, str] | None = None,
    ) -> list[dict[str, Any]]:
        """A tenant's request_log rows admitted in [start, end), newest first in (admitted_at,
        request_id) order, at most `limit`; `after` is the (admitted_at, request_id) of the last
        row of the previous page. The order and the range ride the (tenant_id, admitted_at)
        index; the other filters narrow what it reads."""
        r = request_log
        query = (
            sa.select(
                r.c.request_id, r.c.status, r.c.model, r.c.tier, r.c.key_id, r.c.admitted_at,
                r.c.finished_at, r.c.prompt_tokens, r.c.completion_tokens, r.c.cached_tokens,
                r.c.reject_reason, r.c.replica_id, r.c.refusals, r.c.region, r.c.retention,
                r.c.adapter,
            )
            .where(
                r.c.tenant_id == tenant, r.c.admitted_at >= start, r.c.admitted_at < end,
                _model_filter(r.c.model, model),
            )
            .order_by(r.c.admitted_at.desc(), r.c.request_id.desc())
            .limit(limit)
        )  # fmt: skip
        if status is not None:
            query = query.where(r.c.status == status)
        if key_id is not None:
            query = query.where(r.c.key_id == key_id)
        if after is not None:
            at, request_id = after
            query = query.where(
                sa.or_(
                    r.c.admitted_at < at,
                    sa.and_(r.c.admitted_at == at, r.c.request_id < request_id),
                )
            )
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [_logged_request(row) for row in rows]

    @faults.seam("db.read")
    def request_admitted_at(self, tenant: str, request_id: str) -> datetime | None:
        """When a tenant's request was admitted (None: no such request of that tenant), the
        anchor of the next page of `requests`."""
        r = request_log
        with self.engine.connect() as conn:
            at: datetime | None = conn.execute(
                sa.select(r.c.admitted_at).where(
                    r.c.request_id == request_id, r.c.tenant_id == tenant
                )
            ).scalar()
        return at

    def goodput(
        self,
        tenant: str | None,
        start: datetime,
        end: datetime,
        group_by: Sequence[str],
        slo_of: Callable[[str, datetime], Slo],
    ) -> list[dict[str, Any]]:
        """Requests that ended in [start, end), classified by `domain.goodput.outcome` against
        the objective in force at each one's admission (`slo_of(tier, admitted_at)`, the
        control plane's history), counted per group of `group_by` (tenant, tier, model, hour of
        the end). Read from the request log, a projection of the events (rebuildable), so the
        figures are the events' own; the edges' live counters classify with the same function."""
        r = request_log
        query = sa.select(
            r.c.tenant_id, r.c.tier, r.c.model, r.c.status, r.c.ttft_ms, r.c.tpot_us,
            r.c.reject_reason, r.c.admitted_at, r.c.finished_at, r.c.refusals,
        ).where(r.c.finished_at >= start, r.c.finished_at < end)
        if tenant is not None:
            query = query.where(r.c.tenant_id == tenant)
        groups: dict[tuple[Any, ...], dict[str, int]] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(query):
                found = outcome(
                    row.status,
                    slo_of(row.tier, row.admitted_at),
                    ttft_ms=row.ttft_ms,
                    tpot_us=row.tpot_us,
                    reject_reason=row.reject_reason,
                )
                if found is None:
                    continue
                key = tuple(_group_value(row, g) for g in group_by)
                counts = groups.setdefault(key, {})
                # A row of counted refusals (domain.refusals) stands for `refusals` of them.
                counts[found] = counts.get(found, 0) + (row.refusals or 1)
        out = []
        for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
            counts = groups[key]
            a = Attainment(counts)
            out.append(
                {
                    **dict(zip(group_by, key, strict=True)),
                    **{o: counts.get(o, 0) for o in OUTCOMES},
                    "served": a.served,
                    "offered": a.offered,
                    "attainment_ppm": a.attainment_ppm,
                    "goodput_ppm": a.goodput_ppm,
                }
            )
        return out

    def invoice(self, tenant: str, period: str) -> dict[str, Any]:
        """One tenant's invoice for a calendar month: a line per model, LoRA adapter (null: the
        base model) and price in force (a price is in one currency), and a total per currency
        (`totals`): a month in which the currency setting changed is never summed across
        currencies. `currency`, `amount_micros`
        and `amount` are that total's when the month has one currency (none: 0, no currency);
        null when it has more than one."""
        start, end = month_bounds(period)
        e = ledger_entries
        query = (
            sa.select(
                e.c.model,
                e.c.adapter,
                e.c.prompt_micros_per_mtok,
                e.c.completion_micros_per_mtok,
                e.c.cached_micros_per_mtok,
                e.c.currency,
                sa.func.count().label("requests"),
                sa.func.sum(e.c.prompt_tokens - e.c.cached_tokens).label("uncached_prompt_tokens"),
                sa.func.sum(e.c.cached_tokens).label("cached_tokens"),
                sa.func.sum(e.c.completion_tokens).label("completion_tokens"),
                sa.func.sum(e.c.amount_micros).label("amount_micros"),
            )
            .where(e.c.tenant_id == tenant, e.c.finished_at >= start, e.c.finished_at < end)
            .group_by(
                e.c.model,
                e.c.adapter,
                e.c.prompt_micros_per_mtok,
                e.c.completion_micros_per_mtok,
                e.c.cached_micros_per_mtok,
                e.c.currency,
            )
            .order_by(e.c.currency, e.c.model, e.c.adapter, e.c.prompt_micros_per_mtok)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        # PostgreSQL sums bigints as NUMERIC: every figure comes back as an exact int.
        lines = [
            {str(k): (v if isinstance(v, str) or v is None else int(v)) for k, v in r.items()}
            for r in rows
        ]
        totals = currency_totals(lines)
        single = totals[0] if len(totals) == 1 else None
        return {
            "tenant": tenant,
            "period": period,
            "period_start": _iso(start),
            "period_end": _iso(end),
            "currency_unit": "micro",
            "lines": lines,
            "totals": totals,
            "requests": sum(line["requests"] for line in lines),
            "currency": single["currency"] if single else None,
            "amount_micros": single["amount_micros"] if single else (None if totals else 0),
            "amount": single["amount"] if single else (None if totals else _money(0)),
        }

    def reconciliation(
        self, store: EventStore, start: datetime, end: datetime, grace_s: int = 60
    ) -> dict[str, Any]:
        """For requests admitted in [start, end): admitted vs terminal vs refunded vs ledger
        entries, reserved vs refunded vs billed tokens, and every mismatch by request id. Each
        request's events are read through the store (and its upcasters) and checked by
        `domain.reconcile.account`, the rules support's replay applies too; what is checked
        here on top is the billing projection: a bill without its ledger row. A request younger
        than `grace_s` without its terminal event is in flight, not a mismatch."""
        ids = store.streams_with("RequestAdmitted", start, end)
        streams = store.read_streams(ids)
        with self.engine.connect() as conn:
            ledger_ids = posted(conn, ids)
        now = datetime.now(UTC)
        totals = dict.fromkeys(
            (
                "admitted",
                "terminal",
                "refunded",
                "billed_events",
                "ledger_entries",
                "reserved_tokens",
                "refunded_tokens",
                "used_tokens",
                "billed_tokens",
                "in_flight",
            ),
            0,
        )
        mismatches: list[dict[str, str]] = []
        for rid in ids:
            acc = account(rid, streams.get(rid, ()), now, grace_s)
            totals["admitted"] += 1
            totals["terminal"] += acc.terminals
            totals["refunded"] += acc.refunds
            totals["billed_events"] += acc.bills
            totals["ledger_entries"] += rid in ledger_ids
            totals["reserved_tokens"] += acc.reserved_tokens
            totals["refunded_tokens"] += acc.refunded_tokens
            totals["used_tokens"] += acc.used_tokens
            totals["billed_tokens"] += acc.billed_tokens
            totals["in_flight"] += acc.in_flight
            mismatches += [{"request_id": rid, "problem": f.detail} for f in acc.findings]
            if acc.terminals and rid not in ledger_ids:
                mismatches.append(
                    {
                        "request_id": rid,
                        "problem": "no ledger entry (billing projection behind or broken)",
                    }
                )
        return {
            "from": _iso(start),
            "to": _iso(end),
            "totals": totals,
            "mismatches": mismatches,
            "ok": not mismatches,
        }


def posted(conn: sa.Connection, request_ids: Sequence[str]) -> set[str]:
    """Which of `request_ids` have their ledger row: their bill is posted (a row is written
    only in the transaction that adds its bill to usage_hourly). 1,000 ids a query: SQLite's
    bind-parameter cap."""
    found: set[str] = set()
    for first in range(0, len(request_ids), 1000):
        chunk = list(request_ids[first : first + 1000])
        query = sa.select(ledger_entries.c.request_id).where(ledger_entries.c.request_id.in_(chunk))
        found.update(conn.execute(query).scalars())
    return found


GOODPUT_GROUPS: Final = ("tenant", "tier", "model", "hour")
GOODPUT_COLUMNS: Final = (*OUTCOMES, "served", "offered", "attainment_ppm", "goodput_ppm")


def currency_totals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Requests and amount per currency of rows that each carry `currency`, `requests` and
    `amount_micros`, in currency order: the one way a total is taken, never across currencies."""
    sums: dict[str, list[int]] = {}
    for row in rows:
        acc = sums.setdefault(row["currency"], [0, 0])
        acc[0] += row["requests"]
        acc[1] += row["amount_micros"]
    return [
        {"currency": c, "requests": n, "amount_micros": a, "amount": _money(a)}
        for c, (n, a) in sorted(sums.items())
    ]


def _group_value(row: Any, group: str) -> Any:
    if group == "tenant":
        return row.tenant_id
    if group == "hour":
        return _iso(row.finished_at.replace(minute=0, second=0, microsecond=0))
    return getattr(row, group)


def _hour_text(hour: str | datetime) -> str:
    return hour if isinstance(hour, str) else hour.strftime("%Y-%m-%dT%H:%M:%SZ")


def _usage_row(tenant: str, model: str, when: datetime, r: Any) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "model": model,
        "period_start": _iso(when),
        **{f: int(getattr(r, f) or 0) for f in USAGE_FIELDS},
    }


def _entry(row: dict[str, Any]) -> dict[str, Any]:
    out = {
        "request_id": row["request_id"],
        "tenant": row["tenant_id"],
        "key_id": row["key_id"],
        "model": row["model"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "cached_tokens": row["cached_tokens"],
        "prompt_micros_per_mtok": row["prompt_micros_per_mtok"],
        "completion_micros_per_mtok": row["completion_micros_per_mtok"],
        "cached_micros_per_mtok": row["cached_micros_per_mtok"],
        "amount_micros": row["amount_micros"],
        "terminal_reason": row["terminal"],
        "admitted_at": _iso(row["admitted_at"]),
        "finished_at": _iso(row["finished_at"]),
        "billed_at": _iso(row["billed_at"]),
        "workspace_id": row.get("workspace_id"),
        "project_id": row.get("project_id"),
        "run_id": row.get("run_id"),
        "currency": row["currency"],
        "adapter": row.get("adapter"),
    }
    return out


def _logged_request(row: Any) -> dict[str, Any]:
    finished = row["finished_at"]
    return {
        "request_id": row["request_id"],
        "status": row["status"],
        "model": row["model"],
        "tier": row["tier"],
        "key_id": row["key_id"],
        "admitted_at": _iso(row["admitted_at"]),
        "finished_at": None if finished is None else _iso(finished),
        "tokens": {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "cached_tokens": row["cached_tokens"],
        },
        "reject_reason": row["reject_reason"],
        "replica": row["replica_id"],
        "region": row["region"],
        "retention": row["retention"],
        "adapter": row["adapter"],
        # A row of counted refusals (domain.refusals) stands for this many; else NULL, one.
        "refusals": row["refusals"],
    }


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _money(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"
