"""Server-rendered web views for support and finance (issue 4): no build step, no CDN, inline CSS
and inline SVG only. Every page goes through `Backoffice`, so the visibility rules are the API's:
support/admin read any request, a customer only its own (another tenant's id answers exactly
like an unknown one); finance/admin read every tenant's billing, a customer only its own.

Browser authentication: `POST /ui/login` (form field `key`) sets an HttpOnly, SameSite=Strict
cookie scoped to /ui holding the key. Pages read the key from that cookie or from an
`Authorization: Bearer` header; `?key=...` on any /ui page is accepted once: it sets the cookie
and redirects to the same URL without it. A missing or bad key renders the login page (401).

All text reaches the HTML through Jinja2 with autoescape on; charts are computed here as plain
numbers and drawn by the templates.
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from api.backoffice import (
    ENTRY_COLUMNS,
    INVOICE_COLUMNS,
    USAGE_COLUMNS,
    parse_range,
    timeline_json,
    to_csv,
)
from api.edge import Caller, new_request_id, utcnow
from api.errors import ApiError
from api.runtime import Runtime

COOKIE = "tollgate_key"
COOKIE_PATH = "/ui"
COOKIE_MAX_AGE = 8 * 3600
ALL_SCOPES = frozenset({"customer", "finance", "support", "admin"})
MAX_LOGIN_BODY = 8192
MAX_TABLE_ROWS = 500
MAX_HOUR_BUCKETS = 96  # beyond this the bar chart groups by day
MIN_BUCKETS = 24  # a short span is drawn as the day that ends with it
MAX_BAR_WIDTH = 44.0
STACKS = ("tenant", "model", "kind")
# Okabe-Ito, readable by colour-blind readers; cycles past eight series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")
KIND_COLOURS = {"prompt (uncached)": "#0072B2", "cached": "#56B4E9", "completion": "#E69F00"}
# Which timeline rows an anomaly points at, so the table can flag them.
ANOMALY_EVENTS = {
    "lease_expired": "LeaseExpired",
    "refund_mismatch": "QuotaRefunded",
    "bill_mismatch": "UsageBilled",
    "not_refunded": "QuotaRefunded",
}

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _money(micros: int | None) -> str:
    if micros is None:
        return "—"
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(int(micros)), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def _num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _short_time(iso: str) -> str:
    """'2026-11-29T10:21:29.001591Z' -> '2026-11-29 10:21:29.001Z'."""
    date, _, rest = iso.partition("T")
    clock, dot, frac = rest.rstrip("Z").partition(".")
    return f"{date} {clock}{'.' + frac[:3] if dot else ''}Z"


def make_environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        autoescape=select_autoescape(["html", "svg", "xml"], default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["money"] = _money
    env.filters["num"] = _num
    env.filters["short_time"] = _short_time
    env.globals["zip"] = zip
    return env


# --- charts ------------------------------------------------------------------------------------


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    colour: str
    title: str


@dataclass
class Tick:
    pos: float
    label: str


@dataclass
class Chart:
    """An SVG chart already laid out: the template only draws what is here."""

    width: int
    height: int
    plot: tuple[float, float, float, float]  # left, top, right, bottom
    bars: list[Bar] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    y2_ticks: list[Tick] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    line: str = ""  # polyline points
    dots: list[tuple[float, float, str]] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)
    y_label: str = ""
    y2_label: str = ""
    empty: bool = False


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def _compact(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _floor_hour(iso: str) -> datetime:
    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return when.replace(minute=0, second=0, microsecond=0)


def _series_key(row: dict[str, Any], stack: str) -> list[tuple[str, int]]:
    if stack == "kind":
        cached = int(row["cached_tokens"])
        return [("prompt (uncached)", int(row["prompt_tokens"]) - cached), ("cached", cached),
                ("completion", int(row["completion_tokens"]))]
    label = row["tenant"] if stack == "tenant" else row["model"]
    return [(label, int(row["prompt_tokens"]) + int(row["completion_tokens"]))]


def time_chart(rows: list[dict[str, Any]], stack: str) -> tuple[Chart, str]:
    """Stacked bars of tokens per hour (or per day when the span is long), stacked by tenant,
    model or token kind, with the billed amount as a line on the right axis."""
    width, height = 1160, 340
    left, top, right, bottom = 78.0, 18.0, width - 86.0, height - 46.0
    chart = Chart(width, height, (left, top, right, bottom), y_label="tokens",
                  y2_label="amount")
    if not rows:
        chart.empty = True
        return chart, "hour"
    hours = [_floor_hour(r["period_start"]) for r in rows]
    first, last = min(hours), max(hours)
    span_hours = int((last - first).total_seconds() // 3600) + 1
    unit = "hour" if span_hours <= MAX_HOUR_BUCKETS else "day"
    step = timedelta(hours=1) if unit == "hour" else timedelta(days=1)
    if unit == "day":
        first = first.replace(hour=0)
        last = last.replace(hour=0)
    first = min(first, last - (MIN_BUCKETS - 1) * step)
    buckets: list[datetime] = []
    cursor = first
    while cursor <= last:
        buckets.append(cursor)
        cursor += step
    index = {b: i for i, b in enumerate(buckets)}
    values: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))
    amounts = [0] * len(buckets)
    for row, hour in zip(rows, hours, strict=True):
        i = index[hour if unit == "hour" else hour.replace(hour=0)]
        for name, tokens in _series_key(row, stack):
            values[name][i] += tokens
        amounts[i] += int(row["amount_micros"])
    names = list(KIND_COLOURS) if stack == "kind" else sorted(values)
    colours = {
        name: KIND_COLOURS.get(name) or PALETTE[n % len(PALETTE)] for n, name in enumerate(names)
    }
    chart.legend = [(name, colours[name]) for name in names]
    totals = [sum(values[name][i] for name in names) for i in range(len(buckets))]
    y_max = _nice_max(max(totals))
    a_max = _nice_max(max(amounts) / 1e6)
    plot_w, plot_h = right - left, bottom - top
    slot = plot_w / len(buckets)
    bar_w = min(MAX_BAR_WIDTH, max(1.0, slot * 0.72))
    label = "%Y-%m-%d %H:00" if unit == "hour" else "%Y-%m-%d"
    for i, when in enumerate(buckets):
        x = left + i * slot + (slot - bar_w) / 2
        base = bottom
        for name in names:
            v = values[name][i]
            if v <= 0:
                continue
            h = v / y_max * plot_h
            base -= h
            chart.bars.append(Bar(round(x, 2), round(base, 2), round(bar_w, 2), round(h, 2),
                                  colours[name],
                                  f"{when.strftime(label)} · {name}: {v:,} tokens"))
    points = []
    for i, amount in enumerate(amounts):
        cx = left + i * slot + slot / 2
        cy = bottom - (amount / 1e6) / a_max * plot_h
        points.append(f"{cx:.2f},{cy:.2f}")
        chart.dots.append((round(cx, 2), round(cy, 2),
                           f"{buckets[i].strftime(label)} · amount {_money(amount)}"))
    chart.line = " ".join(points)
    decimals = max(2, min(6, math.ceil(-math.log10(a_max)) + 2))
    for k in range(5):
        frac = k / 4
        y = bottom - frac * plot_h
        chart.y_ticks.append(Tick(round(y, 2), _compact(y_max * frac)))
        chart.y2_ticks.append(Tick(round(y, 2), f"{a_max * frac:.{decimals}f}"))
    stride = max(1, math.ceil(len(buckets) / 10))
    tick_format = "%m-%d %H:00" if unit == "hour" else "%m-%d"
    for i in range(0, len(buckets), stride):
        chart.x_ticks.append(Tick(round(left + i * slot + slot / 2, 2),
                                  buckets[i].strftime(tick_format)))
    return chart, unit


def totals_chart(summary: list[dict[str, Any]]) -> Chart:
    """Horizontal bars: billed amount per tenant and model over the range."""
    row_h, width = 26, 1160
    left, right = 330.0, width - 150.0
    height = int(30 + row_h * max(1, len(summary)))
    chart = Chart(width, height, (left, 10.0, right, height - 20.0))
    if not summary:
        chart.empty = True
        return chart
    a_max = max(int(r["amount_micros"]) for r in summary) or 1
    tenants = sorted({r["tenant"] for r in summary})
    colours = {t: PALETTE[n % len(PALETTE)] for n, t in enumerate(tenants)}
    for i, r in enumerate(summary):
        y = 10 + i * row_h
        w = max(1.0, (right - left) * int(r["amount_micros"]) / a_max)
        chart.bars.append(Bar(left, y + 4, round(w, 2), row_h - 8, colours[r["tenant"]],
                              f"{r['tenant']} · {r['model']}: {_money(r['amount_micros'])} "
                              f"({r['prompt_tokens'] + r['completion_tokens']:,} tokens, "
                              f"{r['requests']:,} requests)"))
        chart.y_ticks.append(Tick(y + row_h / 2, f"{r['tenant']} · {r['model']}"))
        chart.x_ticks.append(Tick(y + row_h / 2, _money(r["amount_micros"])))
    chart.legend = [(t, colours[t]) for t in tenants]
    return chart


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    fields = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        bucket = out.setdefault((r["tenant"], r["model"]),
                                {"tenant": r["tenant"], "model": r["model"],
                                 **dict.fromkeys(fields, 0)})
        for f in fields:
            bucket[f] += int(r[f])
    return [out[k] for k in sorted(out)]


def total_of(rows: list[dict[str, Any]]) -> dict[str, int]:
    fields = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")
    return {f: sum(int(r[f]) for r in rows) for f in fields}


# --- authentication ----------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    """Only a local /ui path may be a redirect target (no open redirect)."""
    if (not target or not target.startswith("/ui") or target.startswith("//")
            or "\\" in target or any(ord(c) < 32 for c in target)):
        return "/ui/"
    return target


def _without_key(request: Request) -> str:
    query = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
    path = request.url.path
    return path + ("?" + urllib.parse.urlencode(query) if query else "")


def _set_cookie(response: Response, request: Request, secret: str) -> None:
    response.set_cookie(
        COOKIE, secret, max_age=COOKIE_MAX_AGE, path=COOKIE_PATH, httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )


def _clear_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")


SECURITY_HEADERS = {
    # Inline CSS and inline SVG only: no script, no external anything.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


class WebViews:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.env = make_environment()

    # -- rendering

    def page(self, request: Request, template: str, status: int = 200, **context: Any) -> Response:
        html = self.env.get_template(template).render(request_path=request.url.path, **context)
        headers = {**SECURITY_HEADERS,
                   "X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        return HTMLResponse(html, status, headers)

    def login_page(self, request: Request, message: str | None, status: int,
                   next_url: str | None = None, clear: bool = False) -> Response:
        response = self.page(request, "login.html", status, message=message,
                             next_url=_safe_next(next_url or _without_key(request)), caller=None)
        if clear:
            _clear_cookie(response, request)
        return response

    # -- who is asking

    def _authenticate(self, secret: str) -> Caller:
        return self.runtime.edge.authenticate(f"Bearer {secret}", ALL_SCOPES)

    def session(self, request: Request) -> Caller | Response:
        """The caller, or the response to send instead (a redirect that stores a `?key=` in the
        cookie, or the login page)."""
        request.state.request_id = new_request_id()
        url_key = request.query_params.get("key")
        if url_key is not None:
            try:
                self._authenticate(url_key.strip())
            except ApiError as exc:
                return self.login_page(request, exc.message, 401)
            response = RedirectResponse(_without_key(request), 303, headers=SECURITY_HEADERS)
            _set_cookie(response, request, url_key.strip())
            return response
        header = request.headers.get("authorization")
        cookie = request.cookies.get(COOKIE)
        if header:
            authorization = header
        elif cookie:
            authorization = f"Bearer {cookie}"
        else:
            return self.login_page(request, "Sign in with an API key to continue.", 401)
        try:
            return self.runtime.edge.authenticate(authorization, ALL_SCOPES)
        except ApiError as exc:
            return self.login_page(request, exc.message, 401, clear=bool(cookie and not header))

    # -- pages

    async def login_form(self, request: Request) -> Response:
        request.state.request_id = new_request_id()
        return self.login_page(request, None, 200, request.query_params.get("next"))

    async def login_submit(self, request: Request) -> Response:
        request.state.request_id = new_request_id()
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return self.login_page(request, "the form is too large", 413)
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        secret = (form.get("key") or [""])[0].strip()
        next_url = _safe_next((form.get("next") or [""])[0])
        if not secret:
            return self.login_page(request, "Enter an API key.", 401, next_url)
        try:
            caller = self._authenticate(secret)
        except ApiError as exc:
            return self.login_page(request, exc.message, 401, next_url)
        if next_url == "/ui/":
            next_url = _home(caller)
        response = RedirectResponse(next_url, 303, headers=SECURITY_HEADERS)
        _set_cookie(response, request, secret)
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse("/ui/login", 303, headers=SECURITY_HEADERS)
        _clear_cookie(response, request)
        return response

    async def home(self, request: Request) -> Response:
        caller = self.session(request)
        if isinstance(caller, Response):
            return caller
        return RedirectResponse(_home(caller), 303, headers=SECURITY_HEADERS)

    async def support(self, request: Request) -> Response:
        caller = self.session(request)
        if isinstance(caller, Response):
            return caller
        request_id = (request.query_params.get("request_id") or "").strip()
        context: dict[str, Any] = {"caller": caller, "request_id": request_id, "timeline": None,
                                   "error": None, "flagged": set()}
        status = 200
        if request_id:
            try:
                timeline = await asyncio.to_thread(
                    self.runtime.backoffice.timeline, request_id, caller.scope, caller.tenant_id,
                    utcnow(),
                )
            except ApiError as exc:
                status = exc.status
                context["error"] = exc.message
            else:
                data = timeline_json(timeline)
                context["timeline"] = data
                context["flagged"] = {ANOMALY_EVENTS[a["kind"]] for a in data["anomalies"]
                                      if a["kind"] in ANOMALY_EVENTS}
                context["start"] = (
                    datetime.fromisoformat(data["events"][0]["occurred_at"].replace("Z", "+00:00"))
                    if data["events"] else None
                )
                context["offsets"] = [
                    _offset_ms(context["start"], e["occurred_at"]) for e in data["events"]
                ]
        return self.page(request, "support.html", status, **context)

    async def finance(self, request: Request) -> Response:
        caller = self.session(request)
        if isinstance(caller, Response):
            return caller
        q = {k: (v.strip() or None) for k, v in request.query_params.items()}
        bo = self.runtime.backoffice
        now = utcnow()
        context: dict[str, Any] = {
            "caller": caller, "q": q, "error": None, "rows": [], "summary": [],
            "total": total_of([]), "chart": None, "totals": None, "unit": "hour",
            "invoice": None, "invoices": [], "period": q.get("period") or now.strftime("%Y-%m"),
            "tenants": [], "models": [], "links": {}, "stack": "tenant", "truncated": 0,
        }
        try:
            tenant = bo.billing_tenant(caller.scope, caller.tenant_id, q.get("tenant"))
            if caller.scope in ("finance", "admin"):
                context["tenants"] = sorted(t.tenant_id for t in self.runtime.control.tenants())
            with_models = self.runtime.fleet is not None
            context["models"] = ([m["id"] for m in self.runtime.fleet_models()]
                                 if with_models else [])
            start, end = parse_range(q.get("from"), q.get("to"), now)
            stack = q.get("stack") or ("tenant" if tenant is None else "model")
            if stack not in STACKS:
                raise ApiError(400, f"'stack' must be one of {', '.join(STACKS)}", param="stack")
            context.update(tenant=tenant, start=start, end=end, stack=stack)
            rows = await asyncio.to_thread(bo.usage, tenant, start, end, q.get("model"), "hour")
            context["rows"] = list(reversed(rows))[:MAX_TABLE_ROWS]
            context["truncated"] = max(0, len(rows) - MAX_TABLE_ROWS)
            context["summary"] = summarise(rows)
            context["total"] = total_of(rows)
            context["chart"], context["unit"] = time_chart(rows, stack)
            context["totals"] = totals_chart(context["summary"])
            context["links"] = self._links(tenant, start, end, q.get("model"), context["period"])
            if tenant is not None:
                context["invoice"] = await asyncio.to_thread(
                    bo.invoice, tenant, context["period"], now
                )
            else:
                for name in context["tenants"]:
                    inv = await asyncio.to_thread(bo.invoice, name, context["period"], now)
                    if inv["requests"]:
                        context["invoices"].append(inv)
                context["invoices_total"] = sum(i["amount_micros"] for i in context["invoices"])
        except ApiError as exc:
            context["error"] = exc.message
            return self.page(request, "finance.html", exc.status, **context)
        return self.page(request, "finance.html", 200, **context)

    def _links(self, tenant: str | None, start: datetime, end: datetime, model: str | None,
               period: str) -> dict[str, str]:
        common = {"from": _iso(start), "to": _iso(end)}
        if tenant:
            common["tenant"] = tenant
        if model:
            common["model"] = model

        def url(path: str, **extra: str) -> str:
            return path + "?" + urllib.parse.urlencode({**common, **extra, "format": "csv"})

        links = {
            "usage": url("/ui/export/billing/usage", group_by="hour"),
            "ledger": url("/ui/export/billing/ledger", limit="10000"),
            "api_usage": url("/v1/billing/usage", group_by="hour"),
            "api_ledger": url("/v1/billing/ledger", limit="10000"),
        }
        if tenant:
            inv = urllib.parse.quote(tenant, safe="")
            query = urllib.parse.urlencode({"period": period, "format": "csv"})
            links["invoice"] = f"/ui/export/billing/invoices/{inv}?{query}"
            links["api_invoice"] = f"/v1/billing/invoices/{inv}?{query}"
        return links

    # -- CSV downloads: the /v1/billing/* CSVs for a browser, which has a cookie, not a header

    async def export(self, request: Request, kind: str, tenant_path: str | None = None) -> Response:
        caller = self.session(request)
        if isinstance(caller, Response):
            return caller
        q = request.query_params
        bo = self.runtime.backoffice
        try:
            if kind == "invoice":
                assert tenant_path is not None
                bo.billing_tenant(caller.scope, caller.tenant_id, tenant_path)
                invoice = await asyncio.to_thread(bo.invoice, tenant_path, q.get("period"),
                                                  utcnow())
                body = to_csv(invoice["lines"], INVOICE_COLUMNS)
                name = f"invoice-{tenant_path}-{invoice['period']}.csv"
            else:
                tenant = bo.billing_tenant(caller.scope, caller.tenant_id, q.get("tenant") or None)
                start, end = parse_range(q.get("from"), q.get("to"), utcnow())
                model = q.get("model") or None
                if kind == "usage":
                    rows = await asyncio.to_thread(bo.usage, tenant, start, end, model, "hour")
                    body = to_csv(rows, USAGE_COLUMNS)
                else:
                    try:
                        limit = int(q.get("limit") or 1000)
                    except ValueError:
                        raise ApiError(400, "'limit' must be an integer", param="limit") from None
                    rows = await asyncio.to_thread(bo.entries, tenant, start, end, model, limit,
                                                   q.get("after"))
                    body = to_csv(rows, ENTRY_COLUMNS)
                name = f"{kind}-{tenant or 'all'}.csv"
        except ApiError as exc:
            return self.page(request, "error.html", exc.status, caller=caller, error=exc.message)
        safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        headers = {**SECURITY_HEADERS, "X-Request-Id": request.state.request_id,
                   "Content-Disposition": f'attachment; filename="{safe_name}"'}
        return Response(body, 200, headers, media_type="text/csv")


def _home(caller: Caller) -> str:
    return "/ui/finance" if caller.scope in ("finance", "customer") else "/ui/support"


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _offset_ms(start: datetime | None, iso: str) -> float | None:
    if start is None:
        return None
    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return round((when - start).total_seconds() * 1000, 1)


def add_web_routes(app: FastAPI, runtime: Runtime) -> None:
    """Mount the /ui pages on `app` (called by `create_app`)."""
    views = WebViews(runtime)
    app.state.web = views
    app.add_api_route("/ui", views.home, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/", views.home, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/login", views.login_form, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/login", views.login_submit, methods=["POST"], include_in_schema=False)
    app.add_api_route("/ui/logout", views.logout, methods=["POST"], include_in_schema=False)
    app.add_api_route("/ui/support", views.support, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/finance", views.finance, methods=["GET"], include_in_schema=False)

    async def export_usage(request: Request) -> Response:
        return await views.export(request, "usage")

    async def export_ledger(request: Request) -> Response:
        return await views.export(request, "ledger")

    async def export_invoice(request: Request, tenant: str) -> Response:
        return await views.export(request, "invoice", tenant)

    app.add_api_route("/ui/export/billing/usage", export_usage, methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/ui/export/billing/ledger", export_ledger, methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/ui/export/billing/invoices/{tenant}", export_invoice, methods=["GET"],
                      include_in_schema=False)
