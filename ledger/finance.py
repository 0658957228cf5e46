"""Finance queries over the billing projections: ledger entries, usage, invoices, and the
reconciliation report that checks the projections against the events.

Every query takes explicit UTC bounds [start, end) and, where it applies, a tenant; callers
(the API, the CLI) decide what a caller may see. Money is integer micro-units throughout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ledger.schema import events, ledger_entries, usage_hourly

TERMINAL_TYPES = ("RequestCompleted", "RequestCancelled", "RequestFailed", "LeaseExpired")
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


@dataclass(frozen=True)
class FinanceQueries:
    engine: Engine

    def usage(
        self,
        tenant: str | None,
        start: datetime,
        end: datetime,
        model: str | None,
        group_by: str,
    ) -> list[dict[str, Any]]:
        """Usage rows (tenant, model, period_start, requests, tokens, amount_micros) grouped by
        hour, day, model (one row per tenant and model over the range) or key (from entries)."""
        if group_by == "key":
            return self._usage_by_key(tenant, start, end, model)
        u = usage_hourly
        hour: Any = u.c.hour
        if group_by == "hour" and self.engine.dialect.name == "postgresql":
            # The hot finance read: PostgreSQL formats the instant, Python does no datetime work.
            hour = sa.func.to_char(
                sa.func.timezone("UTC", u.c.hour), 'YYYY-MM-DD"T"HH24:MI:SS"Z"'
            )
        query = (
            sa.select(u.c.tenant_id, u.c.model, hour, *(u.c[f] for f in USAGE_FIELDS))
            .where(u.c.hour >= start, u.c.hour < end, _model_filter(u.c.model, model))
            .order_by(u.c.hour, u.c.tenant_id, u.c.model)
        )
        if tenant is not None:
            query = query.where(u.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        if group_by == "hour":
            # The hot finance read (30 days of a big tenant is thousands of rows): rows are
            # built by zip, instants formatted directly (they are UTC whole hours).
            names = ("tenant", "model", "period_start", *USAGE_FIELDS)
            return [
                dict(
                    zip(
                        names,
                        (r[0], r[1], _hour_text(r[2]), *map(int, r[3:])),
                        strict=True,
                    )
                )
                for r in rows
            ]
        buckets: dict[tuple[str, str, datetime], dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(USAGE_FIELDS, 0)
        )
        for r in rows:
            if group_by == "day":
                when = r[2].replace(hour=0, minute=0, second=0, microsecond=0)
            else:  # model
                when = start
            bucket = buckets[(r.tenant_id, r.model, when)]
            for f in USAGE_FIELDS:
                bucket[f] += getattr(r, f)
        return [
            {"tenant": t, "model": m, "period_start": _iso(when), **values}
            for (t, m, when), values in sorted(
                buckets.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])
            )
        ]

    def _usage_by_key(
        self, tenant: str | None, start: datetime, end: datetime, model: str | None
    ) -> list[dict[str, Any]]:
        e = ledger_entries
        query = (
            sa.select(
                e.c.tenant_id,
                e.c.key_id,
                e.c.model,
                sa.func.count().label("requests"),
                sa.func.sum(e.c.prompt_tokens).label("prompt_tokens"),
                sa.func.sum(e.c.completion_tokens).label("completion_tokens"),
                sa.func.sum(e.c.cached_tokens).label("cached_tokens"),
                sa.func.sum(e.c.amount_micros).label("amount_micros"),
            )
            .where(e.c.finished_at >= start, e.c.finished_at < end, _model_filter(e.c.model, model))
            .group_by(e.c.tenant_id, e.c.key_id, e.c.model)
            .order_by(e.c.tenant_id, e.c.key_id, e.c.model)
        )
        if tenant is not None:
            query = query.where(e.c.tenant_id == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [{**_usage_row(r.tenant_id, r.model, start, r), "key_id": r.key_id} for r in rows]

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

    def invoice(self, tenant: str, period: str) -> dict[str, Any]:
        """One tenant's invoice for a calendar month: a line per model and price in force."""
        start, end = month_bounds(period)
        e = ledger_entries
        query = (
            sa.select(
                e.c.model,
                e.c.prompt_micros_per_mtok,
                e.c.completion_micros_per_mtok,
                e.c.cached_micros_per_mtok,
                sa.func.count().label("requests"),
                sa.func.sum(e.c.prompt_tokens - e.c.cached_tokens).label("uncached_prompt_tokens"),
                sa.func.sum(e.c.cached_tokens).label("cached_tokens"),
                sa.func.sum(e.c.completion_tokens).label("completion_tokens"),
                sa.func.sum(e.c.amount_micros).label("amount_micros"),
            )
            .where(e.c.tenant_id == tenant, e.c.finished_at >= start, e.c.finished_at < end)
            .group_by(
                e.c.model,
                e.c.prompt_micros_per_mtok,
                e.c.completion_micros_per_mtok,
                e.c.cached_micros_per_mtok,
            )
            .order_by(e.c.model, e.c.prompt_micros_per_mtok)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        # PostgreSQL sums bigints as NUMERIC: every figure comes back as an exact int.
        lines = [
            {str(k): (v if isinstance(v, str) else int(v)) for k, v in r.items()} for r in rows
        ]
        total = sum(line["amount_micros"] for line in lines)
        return {
            "tenant": tenant,
            "period": period,
            "period_start": _iso(start),
            "period_end": _iso(end),
            "currency_unit": "micro",
            "lines": lines,
            "requests": sum(line["requests"] for line in lines),
            "amount_micros": total,
            "amount": _money(total),
        }

    def reconciliation(self, start: datetime, end: datetime, grace_s: int = 60) -> dict[str, Any]:
        """For requests admitted in [start, end): admitted vs terminal vs refunded vs ledger
        entries, reserved vs refunded vs billed tokens, and every mismatch by request id. A
        request younger than `grace_s` without its terminal event is in flight, not a mismatch."""
        ev = events
        admitted_ids = sa.select(ev.c.stream_id).where(
            ev.c.type == "RequestAdmitted", ev.c.occurred_at >= start, ev.c.occurred_at < end
        )
        wanted = (
            "RequestAdmitted",
            "RequestEstimated",
            *TERMINAL_TYPES,
            "QuotaRefunded",
            "UsageBilled",
        )
        query = (
            sa.select(ev.c.stream_id, ev.c.type, ev.c.occurred_at, ev.c.payload)
            .where(ev.c.stream_id.in_(admitted_ids), ev.c.type.in_(wanted))
            .order_by(ev.c.position)
        )
        per: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(int))
        with self.engine.connect() as conn:
            for stream_id, type_, occurred_at, payload in conn.execute(query):
                r = per[stream_id]
                r[type_] += 1
                if type_ == "RequestAdmitted":
                    r["admitted_at"] = occurred_at
                elif (
                    type_ in ("RequestEstimated", "QuotaRefunded")
                    or type_ in TERMINAL_TYPES
                    or type_ == "UsageBilled"
                ):
                    r[f"{type_}:payload"] = orjson.loads(payload)
            ledger_ids = set(
                conn.execute(
                    sa.select(ledger_entries.c.request_id).where(
                        ledger_entries.c.request_id.in_(admitted_ids)
                    )
                ).scalars()
            )
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

        def flag(rid: str, problem: str) -> None:
            mismatches.append({"request_id": rid, "problem": problem})

        for rid, r in per.items():
            terminal = sum(r[t] for t in TERMINAL_TYPES)
            totals["admitted"] += r["RequestAdmitted"]
            totals["terminal"] += terminal
            totals["refunded"] += r["QuotaRefunded"]
            totals["billed_events"] += r["UsageBilled"]
            totals["ledger_entries"] += rid in ledger_ids
            estimate = r.get("RequestEstimated:payload") or {}
            reserved = int(estimate.get("reserved_tokens", 0))
            totals["reserved_tokens"] += reserved
            if terminal == 0:
                if now - r["admitted_at"] < timedelta(seconds=grace_s):
                    totals["in_flight"] += 1
                else:
                    flag(rid, "admitted without a terminal event")
                continue
            if terminal > 1:
                flag(rid, f"{terminal} terminal events")
            term = next(r[f"{t}:payload"] for t in TERMINAL_TYPES if f"{t}:payload" in r)
            used = int(term["prompt_tokens"]) + int(term["completion_tokens"])
            if r["QuotaRefunded"] != 1:
                flag(rid, f"{r['QuotaRefunded']} refunds")
            else:
                refund = r["QuotaRefunded:payload"]
                totals["refunded_tokens"] += int(refund["refunded_tokens"])
                totals["used_tokens"] += int(refund["used_tokens"])
                if int(refund["refunded_tokens"]) != max(0, reserved - used):
                    flag(
                        rid,
                        f"refund {refund['refunded_tokens']} != reserved {reserved} − used {used}",
                    )
            if r["UsageBilled"] != 1:
                flag(rid, f"{r['UsageBilled']} UsageBilled events")
            else:
                bill = r["UsageBilled:payload"]
                totals["billed_tokens"] += int(bill["prompt_tokens"]) + int(
                    bill["completion_tokens"]
                )
                if (bill["prompt_tokens"], bill["completion_tokens"], bill["cached_tokens"]) != (
                    term["prompt_tokens"],
                    term["completion_tokens"],
                    term["cached_tokens"],
                ):
                    flag(rid, "billed tokens differ from the terminal event's")
            if rid not in ledger_ids:
                flag(rid, "no ledger entry (billing projection behind or broken)")
        return {
            "from": _iso(start),
            "to": _iso(end),
            "totals": totals,
            "mismatches": mismatches,
            "ok": not mismatches,
        }


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
    }
    return out


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _money(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"
