"""Server-rendered web views for support and finance (issue 4): no build step, no CDN, inline CSS
and inline SVG only. Every page goes through `Backoffice`, so the visibility rules are the API's:
support/admin read any request, a customer only its own (another tenant's id answers exactly
like an unknown one); finance/admin read every tenant's billing, a customer only its own.

Browser authentication: `POST /ui/login` (form field `key`) sets an HttpOnly, SameSite=Strict
cookie scoped to /ui holding a signed, expiring session (api/http/sessions.py: the key's id, an
expiry, an HMAC), never the key itself. Pages take that session or an `Authorization: Bearer`
header. A key in a URL (`?key=`) is refused (400), never used: it would sit in the browser's
history and in every log on the way. A missing, expired or bad session renders the login page
(401); a revoked key ends its sessions.

All text reaches the HTML through Jinja2 with autoescape on; charts are laid out as plain numbers
in `api/http/charts.py` and drawn by the templates.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from tollgate_llm.api.http.charts import STACKS, goodput_chart, money, time_chart, totals_chart
from tollgate_llm.api.http.sessions import SESSION_TTL_S
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.backoffice import (
    ENTRY_COLUMNS,
    INVOICE_COLUMNS,
    REQUEST_ID,
    REQUESTS_LIMIT_DEFAULT,
    USAGE_COLUMNS,
    parse_range,
    timeline_json,
    to_csv,
)
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.projections import REQUEST_LOG_STATUSES
from tollgate_llm.domain.requests.events import LeaseExpired, QuotaRefunded, UsageBilled
from tollgate_llm.ledger.finance import currency_totals
from tollgate_llm.ledger.ids import new_request_id, utcnow

COOKIE = "tollgate_session"
OLD_COOKIE = "tollgate_key"  # the raw key, as pages before sessions kept it: cleared on sight
COOKIE_PATH = "/ui"
COOKIE_MAX_AGE = SESSION_TTL_S
ALL_SCOPES = frozenset({"customer", "finance", "support", "admin"})
MAX_LOGIN_BODY = 8192
MAX_TABLE_ROWS = 500
# Which timeline rows an anomaly points at, so the table can flag them.
ANOMALY_EVENTS = {
    "lease_expired": LeaseExpired.EVENT_TYPE,
    "refund_mismatch": QuotaRefunded.EVENT_TYPE,
    "bill_mismatch": UsageBilled.EVENT_TYPE,
    "not_refunded": QuotaRefunded.EVENT_TYPE,
}

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


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
    env.filters["money"] = money
    env.filters["amounts"] = amounts
    env.filters["num"] = _num
    env.filters["short_time"] = _short_time
    env.globals["zip"] = zip
    return env


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tenant, model and currency: amounts in two currencies are never summed."""
    fields = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        bucket = out.setdefault((r["tenant"], r["model"], r["currency"]),
                                {"tenant": r["tenant"], "model": r["model"],
                                 "currency": r["currency"], **dict.fromkeys(fields, 0)})
        for f in fields:
            bucket[f] += int(r[f])
    return [out[k] for k in sorted(out)]


def total_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests and tokens over every row; the amount per currency (`amounts`), never one sum."""
    fields = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
    return {
        **{f: sum(int(r[f]) for r in rows) for f in fields},
        "amounts": currency_totals(rows),
    }


def amounts(totals: list[dict[str, Any]]) -> str:
    """Per-currency totals as the pages show them: "12.340000 USD · 3.000000 EUR"."""
    return " · ".join(f"{money(t['amount_micros'])} {t['currency']}" for t in totals) or "—"


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


def _set_cookie(response: Response, request: Request, session: str) -> None:
    response.set_cookie(
        COOKIE, session, max_age=COOKIE_MAX_AGE, path=COOKIE_PATH, httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )
    if OLD_COOKIE in request.cookies:
        response.delete_cookie(OLD_COOKIE, path=COOKIE_PATH)


def _clear_cookie(response: Response, request: Request) -> None:
    for name in (COOKIE, OLD_COOKIE):
        response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="strict",
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

    def login_page(self, request: Request, status: int, *, error: str | None = None,
                   notice: str | None = None, next_url: str | None = None,
                   clear: bool = False) -> Response:
        """The sign-in form. `error` (red) is for a key that was sent and refused; `notice`
        (neutral) says why a page asked for a sign-in, which is nobody's mistake."""
        response = self.page(request, "login.html", status, error=error, notice=notice,
                             next_url=_safe_next(next_url or _without_key(request)), caller=None)
        if clear:
            _clear_cookie(response, request)
        return response

    # -- who is asking

    def _guarded(self, request: Request, attempt: Callable[[], Caller]) -> Caller:
        """Every sign-in, bearer header and session cookie through the API's one limiter of
        failed authentications per address."""
        limits = request.app.state.limits
        source = limits.source(request.scope.get("client"), request.headers.get("x-forwarded-for"))
        return limits.authenticate(source, attempt)  # type: ignore[no-any-return]

    def session(self, request: Request) -> Caller | Response:
        """The caller (from the Authorization header or the session cookie), or the login page
        to send instead."""
        request.state.request_id = new_request_id()
        if "key" in request.query_params:
            return self.login_page(
                request, 400, error="An API key is never accepted in a URL: sign in with the "
                "form (and revoke that key if the URL was shared or logged).",
            )
        header = request.headers.get("authorization")
        cookie = request.cookies.get(COOKIE)
        try:
            if header:
                return self._guarded(
                    request, lambda: self.runtime.edge.authenticate(header, ALL_SCOPES)
                )
            if cookie:
                key_id = self.runtime.sessions.key_id_of(cookie)
                if key_id is None:
                    return self.login_page(
                        request, 401, notice="Your session has expired: sign in again.",
                        clear=True,
                    )
                return self.runtime.edge.auth.by_key_id(key_id, ALL_SCOPES)
        except ApiError as exc:
            # A refused Authorization header is a key sent and refused; a refused session (its
            # key revoked since) only says why the form is back.
            error, notice = (exc.message, None) if header else (None, exc.message)
            if exc.status == 429:
                return self.login_page(request, 429, error=error, notice=notice)
            return self.login_page(request, 401, error=error, notice=notice,
                                   clear=bool(cookie and not header))
        # Nothing sent yet: the form, with no error.
        return self.login_page(request, 401, clear=OLD_COOKIE in request.cookies)

    # -- pages

    async def login_form(self, request: Request) -> Response:
        request.state.request_id = new_request_id()
        return self.login_page(request, 200, next_url=request.query_params.get("next"))

    async def login_submit(self, request: Request) -> Response:
        request.state.request_id = new_request_id()
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return self.login_page(request, 413, error="the form is too large")
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        secret = (form.get("key") or [""])[0].strip()
        next_url = _safe_next((form.get("next") or [""])[0])
        if not secret:
            return self.login_page(request, 401, error="Enter an API key.", next_url=next_url)
        try:
            caller = self._guarded(
                request, lambda: self.runtime.edge.authenticate(f"Bearer {secret}", ALL_SCOPES)
            )
        except ApiError as exc:
            status = 429 if exc.status == 429 else 401
            return self.login_page(request, status, error=exc.message, next_url=next_url)
        if next_url == "/ui/":
            next_url = _home(caller)
        response = RedirectResponse(next_url, 303, headers=SECURITY_HEADERS)
        _set_cookie(response, request, self.runtime.sessions.issue(caller.key_id))
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
        # The tenant's requests: when their form was sent, and for a customer by default.
        listing = "list" in request.query_params or (
            caller.scope == "customer" and not request_id
        )
        context.update(await self._request_list(request, caller, listing))
        if context["list_error"] is not None:
            status = context["list_status"]
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

    async def _request_list(self, request: Request, caller: Caller,
                            listing: bool) -> dict[str, Any]:
        """The support page's list of a tenant's requests, through the API's one service (its
        rules: support names a tenant, a customer reads only its own)."""
        q = {k: (v.strip() or None) for k, v in request.query_params.items()}
        context: dict[str, Any] = {
            "lq": q, "statuses": REQUEST_LOG_STATUSES, "requests": None, "list_error": None,
            "list_status": 200, "next_page": None, "timeline_id": REQUEST_ID,
        }  # fmt: skip
        if not listing:
            return context
        bo = self.runtime.backoffice
        try:
            tenant = bo.requests_tenant(caller.scope, caller.tenant_id, q.get("tenant"))
            start, end = parse_range(q.get("from"), q.get("to"), utcnow())
            limit_text = q.get("limit") or str(REQUESTS_LIMIT_DEFAULT)
            if not limit_text.isdigit():
                raise ApiError(400, "'limit' must be a whole number", param="limit",
                               code="invalid_value")
            page = await asyncio.to_thread(
                bo.requests, tenant, start, end, status=q.get("status"),
                key_id=q.get("key_id"), model=q.get("model"), limit=int(limit_text),
                after=q.get("after"),
            )  # fmt: skip
        except ApiError as exc:
            context.update(list_error=exc.message, list_status=exc.status)
            return context
        context.update(requests=page, list_start=start, list_end=end)
        if page["has_more"]:
            kept = {k: v for k, v in q.items() if v and k not in ("after", "request_id")}
            query = urllib.parse.urlencode({**kept, "list": "1", "after": page["last_id"]})
            context["next_page"] = f"/ui/support?{query}"
        return context

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
            "goodput": None, "goodput_tiers": [], "flex": [], "tree": None,
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
            goodput = await asyncio.to_thread(bo.goodput, tenant, start, end, ("tier", "hour"))
            context["goodput"] = goodput_chart(goodput)
            context["goodput_tiers"] = await asyncio.to_thread(
                bo.goodput, tenant, start, end, ("tier",)
            )
            context["flex"] = await asyncio.to_thread(bo.flex, tenant, start, end)
            context["links"] = self._links(tenant, start, end, q.get("model"), context["period"])
            if tenant is not None:
                context["invoice"] = await asyncio.to_thread(
                    bo.invoice, tenant, context["period"], now
                )
                context["tree"] = await asyncio.to_thread(bo.spend_tree, tenant, now)
            else:
                for name in context["tenants"]:
                    inv = await asyncio.to_thread(bo.invoice, name, context["period"], now)
                    if inv["requests"]:
                        context["invoices"].append(inv)
                context["invoices_total"] = currency_totals(
                    [t for i in context["invoices"] for t in i["totals"]]
                )
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
