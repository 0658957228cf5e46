"""The ASGI app: the completions route served directly, the rest through FastAPI. Routes parse,
call a service, render; the rules live elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from api.http.batch_routes import add_batch_routes
from api.http.body_limits import bounded, read_body
from api.http.openapi import install as install_openapi
from api.http.schemas import (
    AUTHENTICATED,
    BearerDep,
    Feedback,
    FeedbackCreate,
    Fleet,
    GoodputRows,
    Health,
    IntegerText,
    Invoice,
    LedgerEntries,
    ModelList,
    Readiness,
    Reconciliation,
    RequestList,
    RequestTimeline,
    RoutingSavingsRows,
    Run,
    RunCreate,
    UsageRows,
    answers,
    error_answers,
    request_body,
)
from api.runtime import Runtime
from api.services.auth import Caller, single_authorization
from api.services.backoffice import (
    ENTRY_COLUMNS,
    FORMATS,
    GROUP_BY,
    GROUP_COLUMNS,
    INVOICE_COLUMNS,
    MAX_ENTRIES,
    REQUEST_ID,
    REQUESTS_LIMIT_DEFAULT,
    REQUESTS_LIMIT_MAX,
    USAGE_COLUMNS,
    groups,
    parse_range,
    timeline_json,
    to_csv,
)
from api.services.edge import JsonOutcome
from api.services.errors import STORE_AWAY_ERRORS, ApiError, error_body, store_unavailable
from api.services.refusals import REFUSED_STATUSES, RefusalLimits, refused_before_admission
from api.services.routing_savings import SAVINGS_COLUMNS, routing_savings
from domain.projections import REQUEST_LOG_STATUSES
from domain.runs.state import RUN_ID
from ledger.finance import GOODPUT_COLUMNS, GOODPUT_GROUPS
from ledger.ids import new_request_id, utcnow

CUSTOMER = frozenset({"customer", "admin"})
ALL_SCOPES = frozenset({"customer", "finance", "support", "admin"})


def authenticate(
    runtime: Runtime, limits: RefusalLimits, source: str | None, attempt: Callable[[], Caller]
) -> Caller:
    """`attempt`'s caller, through the one limiter of failed authentications (counted)."""
    try:
        return limits.authenticate(source, attempt)
    except ApiError as exc:
        if exc.status == 429:
            runtime.metrics.rejected.labels("auth_failures", "none").inc()
        raise


def request_source(request: Request) -> str | None:
    limits: RefusalLimits = request.app.state.limits
    return limits.source(request.scope.get("client"), request.headers.get("x-forwarded-for"))


def key_caller(
    request: Request, scopes: frozenset[str], authorization: str | None = None
) -> Caller:
    """The caller of the API key a request sends (Authorization), through the limiter."""
    state = request.app.state
    header = authorization or request.headers.get("authorization")
    return authenticate(
        state.runtime, state.limits, request_source(request),
        lambda: state.runtime.edge.authenticate(header, scopes),
    )


def metrics_token(runtime: Runtime, limits: RefusalLimits, request: Request) -> None:
    """With `--metrics-token`, /metrics answers only `Authorization: Bearer <token>` (Prometheus'
    `authorization` setting); a wrong token counts against the client address like a wrong key."""
    token = runtime.settings.metrics_token
    if not token:
        return
    given = request.headers.get("authorization") or ""
    scheme, _, secret = given.partition(" ")

    def attempt() -> None:
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            secret.strip().encode(), token.encode()
        ):
            raise ApiError(
                401, "/metrics needs the metrics token: Authorization: Bearer <token>",
                code="invalid_metrics_token", type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    limits.authenticate(request_source(request), attempt)


async def customer(request: Request, _bearer: BearerDep) -> Caller:
    request.state.request_id = new_request_id()
    return key_caller(request, CUSTOMER)


CustomerDep = Annotated[Caller, Depends(customer)]


async def any_key(request: Request, _bearer: BearerDep) -> Caller:
    request.state.request_id = new_request_id()
    return key_caller(request, ALL_SCOPES)


AnyKeyDep = Annotated[Caller, Depends(any_key)]

# The routes' parameters, typed: FastAPI checks them before the route runs (a bad one is a 400
# naming it, in OpenAI's error body: `_invalid` below) and describes them in /openapi.json. A
# query parameter is absent or text, never null (`openapi.py` drops the null FastAPI writes).

# Empty means "the default", as the web pages' forms send it.
Instant = Annotated[str, WithJsonSchema({
    "anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "maxLength": 0}]
})]  # fmt: skip
TenantQuery = Annotated[
    str | None, Query(description="a tenant (finance keys; a customer key only its own)")
]
FromQuery = Annotated[Instant | None, Query(
    alias="from",
    description="ISO 8601 instant, e.g. 2026-11-01T00:00:00Z (default: 30 days before `to`); "
    "the range is at most 366 days",
)]  # fmt: skip
ToQuery = Annotated[
    Instant | None, Query(alias="to", description="ISO 8601 instant (default: now)")
]
ModelQuery = Annotated[str | None, Query(description="a model name or version")]
FormatQuery = Annotated[Literal[FORMATS], Query(alias="format", description="default json")]
UsageGroupQuery = Annotated[Literal[GROUP_BY], Query(
    description="default hour; key, workspace, project and run add that column (null: the "
    "organization's own, or outside any run)",
)]  # fmt: skip
GOODPUT_GROUPS_PATTERN = "^({0})(,({0}))*$".format("|".join(GOODPUT_GROUPS))
PERIOD = "^[0-9]{4}-(0[1-9]|1[0-2])$"
# Described, not checked here: an id that is not a run's is a run that does not exist (404).
RunIdPath = Annotated[
    str, Path(description="the run's id"),
    WithJsonSchema({"type": "string", "pattern": RUN_ID.pattern}),
]


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def create_app(runtime: Runtime) -> FastAPI:
    app = FastAPI(
        title="Tollgate", version="0.1.0", docs_url=None, redoc_url=None,
        description="Tollgate: an OpenAI-compatible chat-completions API with exact, "
        "event-sourced billing. Authenticate with `Authorization: Bearer <key>`.",
    )  # fmt: skip
    app.state.runtime = runtime
    # A key may be refused as often a minute as its plan lets it make requests.
    app.state.limits = RefusalLimits(
        refusals_per_minute=lambda tenant_id: runtime.control.limits(tenant_id, "*").rpm,
        auth_failures_per_minute=runtime.settings.auth_failures_per_minute,
        trusted_proxies=runtime.settings.trusted_proxies,
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        headers.update(exc.headers)
        return json_response(exc.status, exc.body(), headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        """An unknown route or method answers in OpenAI's error shape like every other error
        (Starlette's own body is `{"detail": ...}`), keeping its headers (a 405's Allow)."""
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"Invalid URL ({request.method} {request.url.path})"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route on the path only; a path
            # has a route per method (each described apart), and the Allow names them all.
            headers["Allow"] = ", ".join(sorted({
                method for route in app.router.routes if isinstance(route, Route)
                and route.matches(request.scope)[0] is not Match.NONE
                for method in route.methods or ()
            }))  # fmt: skip
        answer = ApiError(exc.status_code, message, code=code, headers=headers)
        return await _api_error(request, answer)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        answer = ApiError(400, f"invalid {param or 'request'}: {first.get('msg', '')}",
                          param=param, code="invalid_value")  # fmt: skip
        return await _api_error(request, answer)

    async def _store_away(request: Request, exc: Exception) -> Response:
        answer = store_unavailable(exc)
        if answer is None:  # a database error that is not about reaching it: a bug
            return await _unexpected(request, exc)
        runtime.log.warning("store unavailable on %s: %s", request.url.path, exc)
        return await _api_error(request, answer)

    # Registered per class, not only through the Exception handler below: Starlette re-raises
    # what that one answers, and the server then logs it as a crash (and may drop the
    # connection) for what is a database restart.
    for error in STORE_AWAY_ERRORS:
        app.add_exception_handler(error, _store_away)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        answer = store_unavailable(exc)  # raised from a store error, wrapped on the way
        if answer is not None:
            return await _api_error(request, answer)
        runtime.log.exception("unhandled error on %s", request.url.path)
        headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        return json_response(
            500, error_body("internal error", "server_error", None, "internal_error"), headers
        )

    @app.get(
        "/v1/models", summary="Models on sale",
        response_model=ModelList, responses=answers(401, 403, 429),
    )  # fmt: skip
    async def list_models(request: Request, caller: CustomerDep) -> Response:
        return json_response(
            200,
            {"object": "list", "data": runtime.fleet_models()},
            {"X-Request-Id": request.state.request_id},
        )

    @app.get(
        "/v1/billing/usage", summary="Usage by hour, day, model or key",
        response_model=UsageRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_usage(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None, model: ModelQuery = None,
        group_by: UsageGroupQuery = "hour", fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        rows = await asyncio.to_thread(bo.usage, tenant, since, until, model, group_by)
        extra = GROUP_COLUMNS.get(group_by)
        columns = USAGE_COLUMNS + ((extra,) if extra else ())
        return render_rows(rows, fmt, columns, request.state.request_id)

    @app.get(
        "/v1/billing/ledger", summary="Billing ledger entries, oldest first",
        response_model=LedgerEntries, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_ledger(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None, model: ModelQuery = None,
        fmt: FormatQuery = "json",
        limit: Annotated[
            int, Query(ge=1, le=MAX_ENTRIES, description="default 1000"), IntegerText
        ] = 1000,
        after: Annotated[
            str | None, Query(description="the last request_id of the previous page")
        ] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        rows = await asyncio.to_thread(bo.entries, tenant, since, until, model, limit, after)
        return render_rows(rows, fmt, ENTRY_COLUMNS, request.state.request_id)

    @app.get(
        "/v1/billing/invoices/{tenant}", summary="A tenant's invoice for a calendar month",
        response_model=Invoice, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_invoice(
        request: Request, tenant: Annotated[str, Path(description="the tenant")],
        caller: AnyKeyDep, fmt: FormatQuery = "json",
        period: Annotated[
            str | None, Query(pattern=PERIOD, description="YYYY-MM (default: this month)")
        ] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        invoice = await asyncio.to_thread(bo.invoice, tenant, period, utcnow())
        if fmt == "csv":
            return render_rows(invoice["lines"], fmt, INVOICE_COLUMNS, request.state.request_id)
        return json_response(200, invoice, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/billing/goodput",
        summary="Requests that ended in the range, by outcome against their tier's SLO",
        response_model=GoodputRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_goodput(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None,
        group_by: Annotated[str | None, Query(
            pattern=GOODPUT_GROUPS_PATTERN,
            description=f"comma-separated subset of {', '.join(GOODPUT_GROUPS)} (default tier)",
        )] = None,
        fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        chosen = groups(group_by, GOODPUT_GROUPS, ("tier",), "group_by")
        rows = await asyncio.to_thread(bo.goodput, tenant, since, until, chosen)
        return render_rows(rows, fmt, chosen + GOODPUT_COLUMNS, request.state.request_id)

    @app.get(
        "/v1/billing/reconciliation",
        summary="Admitted vs ended vs refunded vs billed, with every mismatch (finance keys)",
        response_model=Reconciliation, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def billing_reconciliation(
        request: Request, caller: AnyKeyDep, start: FromQuery = None, end: ToQuery = None
    ) -> Response:
        bo = runtime.backoffice
        if bo.billing_tenant(caller.scope, caller.tenant_id, None) is not None:
            raise ApiError(
                403,
                "the reconciliation report is for finance keys",
                type="permission_error",
                code="insufficient_scope",
            )
        since, until = parse_range(start, end, utcnow())
        report = await asyncio.to_thread(bo.reconciliation, since, until)
        return json_response(200, report, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/requests", operation_id="list_requests",
        summary="A tenant's requests, newest first (support keys name the tenant; a customer "
        "its own)",
        response_model=RequestList, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def list_requests(
        request: Request, caller: AnyKeyDep,
        tenant: Annotated[str | None, Query(
            description="the tenant (required for support, admin and finance keys; a customer "
            "key reads its own, and another tenant answers as an unknown one)",
        )] = None,
        start: FromQuery = None, end: ToQuery = None,
        status: Annotated[
            Literal[REQUEST_LOG_STATUSES] | None, Query(description="one request_log status")
        ] = None,
        key_id: Annotated[str | None, Query(description="the key that sent it")] = None,
        model: ModelQuery = None,
        limit: Annotated[int, Query(
            ge=1, le=REQUESTS_LIMIT_MAX, description=f"default {REQUESTS_LIMIT_DEFAULT}"
        ), IntegerText] = REQUESTS_LIMIT_DEFAULT,
        after: Annotated[str | None, Query(
            description="the `last_id` of the previous page: the page after it, older"
        )] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        chosen = bo.requests_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        page = await asyncio.to_thread(
            bo.requests, chosen, since, until, status=status, key_id=key_id, model=model,
            limit=limit, after=after,
        )  # fmt: skip
        return json_response(200, page, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/requests/{request_id}/events", operation_id="get_request_events",
        summary="A request's event timeline, re-folded (support keys; a customer its own)",
        response_model=RequestTimeline, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def request_events(
        request: Request,
        request_id: Annotated[str, Path(
            pattern=REQUEST_ID.pattern, description="the X-Request-Id of a response"
        )],
        caller: AnyKeyDep,
    ) -> Response:  # fmt: skip
        timeline = await asyncio.to_thread(
            runtime.backoffice.timeline, request_id, caller.scope, caller.tenant_id, utcnow()
        )
        return json_response(
            200, timeline_json(timeline), {"X-Request-Id": request.state.request_id}
        )

    @app.post(
        "/v1/feedback", operation_id="create_feedback",
        summary="Score one of your own served requests (0-1), once it has ended",
        response_model=Feedback, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def feedback(request: Request, body: FeedbackCreate, caller: CustomerDep) -> Response:
        answer = await asyncio.to_thread(
            runtime.feedback.record, caller, body.request_id, body.score, body.label or ""
        )
        return json_response(200, answer, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/routing/savings",
        summary="What the router saved in a month against the reference model, per tenant",
        response_model=RoutingSavingsRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def routing_savings_rows(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        month: Annotated[
            str | None, Query(pattern=PERIOD, description="YYYY-MM, UTC (default: this month)")
        ] = None,
        fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        tenant = runtime.backoffice.billing_tenant(caller.scope, caller.tenant_id, tenant)
        rows = await asyncio.to_thread(
            routing_savings, runtime.store, runtime.control, tenant,
            month or utcnow().strftime("%Y-%m"),
        )  # fmt: skip
        return render_rows(rows, fmt, SAVINGS_COLUMNS, request.state.request_id)

    @app.post(
        "/v1/runs",
        summary="Start an agent run with a budget (limits not given: the project's policy)",
        response_model=Run, responses=answers(
            *AUTHENTICATED, 404, 409, 413, description="the run, started"
        ),
        openapi_extra=request_body(RunCreate, required=False),
    )  # fmt: skip
    async def runs_start(request: Request, caller: CustomerDep) -> Response:
        raw = await request.body()
        run = await asyncio.to_thread(runtime.runs.start, caller, raw)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/runs/{run_id}",
        summary="A run's budget, consumption and state (the caller's tenant's runs only)",
        response_model=Run, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def runs_show(request: Request, run_id: RunIdPath, caller: CustomerDep) -> Response:
        run = runtime.runs.show(caller, run_id)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})

    @app.post(
        "/v1/runs/{run_id}/end",
        summary="End a run: its later calls are refused (run_budget_exceeded, ended)",
        response_model=Run, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def runs_end(request: Request, run_id: RunIdPath, caller: CustomerDep) -> Response:
        run = await asyncio.to_thread(runtime.runs.end, caller, run_id)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/fleet",
        summary="Every replica as the router sees it, and the autoscaling signal (admin keys)",
        response_model=Fleet, responses=answers(*AUTHENTICATED, 503),
    )  # fmt: skip
    async def fleet(caller: AnyKeyDep) -> Response:
        if caller.scope != "admin":
            raise ApiError(403, "the fleet view is for admin keys", type="permission_error",
                           code="insufficient_scope")
        if runtime.scaling is None:
            raise ApiError(503, "the fleet is starting", type="server_error", code="starting")
        return json_response(200, runtime.scaling.view())

    @app.get(
        "/healthz", summary="Liveness", response_model=Health,
        responses={200: {"description": "alive"}},
    )  # fmt: skip
    async def healthz() -> Response:
        return json_response(200, {"status": "ok"})

    @app.get(
        "/readyz", summary="Readiness: folds healthy, control plane followed, a replica healthy",
        response_model=Readiness, responses={
            200: {"description": "ready"}, 503: {"model": Readiness, "description": "not ready"},
        },
    )  # fmt: skip
    async def readyz() -> Response:
        # Off the event loop: once a second it reads the pipeline's state from the database.
        problems, warnings = await asyncio.to_thread(runtime.readiness)
        status = 503 if problems else 200
        return json_response(
            status,
            {
                "status": "ready" if not problems else "not_ready",
                "problems": problems,
                "warnings": warnings,
            },
        )

    @app.get(
        "/metrics",
        summary="Prometheus metrics (with `--metrics-token`: `Authorization: Bearer <token>`)",
        response_class=Response, responses={
            200: {"description": "Prometheus text format",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_answers(401, 429),
        },
    )  # fmt: skip
    async def metrics(request: Request) -> Response:
        metrics_token(runtime, app.state.limits, request)
        runtime.refresh_gauges()
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_batch_routes(app, runtime.batches, customer, json_response)

    from api.http.web import add_web_routes  # the /ui pages (issue 4)

    add_web_routes(app, runtime)
    install_openapi(app, lambda: runtime.edge.models())
    return TollgateApp(runtime, app, app.state.limits)


class TollgateApp:
    """The ASGI application. `POST /v1/chat/completions` is served here directly: it is the hot
    path, and FastAPI's routing, dependency solving and middleware stack cost more CPU per request
    than the whole of admission (measured with py-spy, bench/gateway.py). Every other route goes
    through the FastAPI app."""

    def __init__(self, runtime: Runtime, api: FastAPI, limits: RefusalLimits) -> None:
        self.runtime = runtime
        self.api = api
        self.limits = limits
        self.tracing = runtime.tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        # Before any route: two Authorization headers are refused alike everywhere.
        refused = single_authorization(scope["headers"])
        if refused is not None:
            headers = {"X-Request-Id": new_request_id()}
            await json_response(400, refused.body(), headers)(scope, receive, send)
        elif scope["path"] == "/v1/chat/completions":
            await self.chat_completions(scope, receive, send)
        else:
            await bounded(self.api, scope, receive, send)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The few headers this route reads, from one dict (ASGI names are lower-case): Starlette's
        # Headers scans and decodes the whole list on every lookup.
        headers = dict(scope["headers"])
        request_id = new_request_id()
        runtime = self.runtime
        watch: _DisconnectWatch | None = None
        frames: Any = None
        dropped: Any = None
        caller: Caller | None = None
        limits = self.limits
        # Tracing on: this request's spans (api/services/tracing.py); off, None and nothing else.
        trace = None if self.tracing is None else self.tracing.request(headers, request_id)
        started = 0 if trace is None else trace.now()
        status = 200
        try:
            if scope["method"] != "POST":
                raise ApiError(
                    405, "use POST for /v1/chat/completions", code="method_not_allowed",
                    headers={"Allow": "POST"},
                )
            batch_item = _header(headers, b"x-tollgate-batch-item") or ""
            authorization = _header(headers, b"authorization")
            source = limits.source(scope.get("client"), _header(headers, b"x-forwarded-for"))
            if batch_item:  # the batch runner, for the key that created the batch
                on_behalf = _header(headers, b"x-tollgate-on-behalf-of") or ""
                caller = authenticate(runtime, limits, source, lambda: runtime.edge.auth.on_behalf(
                    authorization, runtime.settings.batch_token, on_behalf,
                ))  # fmt: skip
            else:
                caller = authenticate(
                    runtime, limits, source,
                    lambda: runtime.edge.authenticate(authorization, CUSTOMER),
                )  # fmt: skip
            if trace is not None:
                trace.authenticated(started, caller.tenant_id)
            idempotency_key = idempotency_key_of(_header(headers, b"idempotency-key"))
            raw = await read_body(
                receive, headers.get(b"content-length"), runtime.settings.max_body_bytes
            )
            if raw is None:
                return  # the client left while sending the body: nothing was admitted
            wait_s = limits.over_budget(caller.key_id, caller.tenant_id)
            if wait_s and refused_before_admission(raw, runtime.edge.resolve_model):
                caller = None  # answered without being counted again, or recorded
                runtime.metrics.rejected.labels("refusals", "any").inc()
                raise limits.throttled(wait_s)
            # From here a client disconnect cancels this task: the edge records the
            # cancellation and aborts the engine request (closing its stream).
            watch = _DisconnectWatch(receive)
            outcome = await runtime.edge.chat(
                caller,
                raw,
                request_id=request_id,
                idempotency_key=idempotency_key,
                retry_count=_int_header(_header(headers, b"x-stainless-retry-count")),
                run_id=run_id_of(_header(headers, b"x-tollgate-run-id")),
                batch_item=batch_item[:200],
                trace=trace,
            )
            if isinstance(outcome, JsonOutcome):
                status = outcome.status
                response = Response(
                    outcome.body, outcome.status, outcome.headers, media_type="application/json"
                )
                await response(scope, receive, send)
                return
            frames = outcome.frames
            dropped = outcome.dropped
            headers = [
                (k.lower().encode(), v.encode()) for k, v in outcome.headers.items()
            ] + _SSE_HEADERS
            if trace is not None:
                trace.stream_started()
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if outcome.first:
                await send({"type": "http.response.body", "body": outcome.first, "more_body": True})
            async for frame in frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            frames = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if trace is not None:
                trace.stream_ended()
        except asyncio.CancelledError:
            if dropped is not None and dropped():
                # A slow reader the edge cancelled, which then read nothing more: its connection
                # is aborted, since closing it would wait for the client to read the buffer.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                _abort_connection(send)
            elif watch is None or not watch.fired:
                raise
            else:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the client left
        except ApiError as exc:
            status = exc.status
            if trace is not None and not trace.authenticated_at and exc.status in (401, 403, 429):
                trace.authenticated(started, None, str(exc.code or exc.type))
            if caller is not None and exc.status in REFUSED_STATUSES:
                limits.refused(caller.key_id, caller.tenant_id)
            headers = {"X-Request-Id": request_id, **exc.headers}
            await json_response(exc.status, exc.body(), headers)(scope, receive, send)
        except Exception as exc:
            ids = {"request_id": request_id, "tenant_id": caller and caller.tenant_id}
            answer = store_unavailable(exc)
            status = 500 if answer is None else answer.status
            if answer is not None:
                runtime.log.warning("store unavailable on /v1/chat/completions: %s", exc, extra=ids)
                headers = {"X-Request-Id": request_id, **answer.headers}
                await json_response(answer.status, answer.body(), headers)(scope, receive, send)
                return
            runtime.log.exception("unhandled error on /v1/chat/completions", extra=ids)
            await json_response(
                500, error_body("internal error", "server_error", None, "internal_error"),
                {"X-Request-Id": request_id},
            )(scope, receive, send)
        finally:
            if watch is not None:
                watch.stop()
            if frames is not None:  # left mid-stream: the edge cancels and bills what was sent
                with contextlib.suppress(BaseException):
                    await frames.aclose()
            if trace is not None:
                trace.end(status)


def _abort_connection(send: Send) -> None:
    """Drop the client's TCP connection at once. uvicorn's `send` is a method of the request
    cycle, which holds the transport; another server's is left to close it its own way."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None and hasattr(transport, "abort"):
        transport.abort()


_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (uvicorn's `receive` answers
    http.disconnect then), until `stop()`: one small task instead of a task group."""

    def __init__(self, receive: Receive) -> None:
        self.fired = False
        self._stopped = False
        self._owner = asyncio.current_task()
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # `receive` also answers http.disconnect once the response is complete (or the
        # connection closed); `stop()` runs right after the last send, before this task can
        # resume, so the watch then ends here on its own.
        if not self._stopped and self._owner is not None:
            self.fired = True
            self._owner.cancel()

    def stop(self) -> None:
        # Not by cancelling the task: a cancelled task keeps its CancelledError, whose traceback
        # holds the frames that hold the task, and that cycle (with uvicorn's request cycle in
        # it) was left to the garbage collector on every request: ~22 objects per request,
        # most of the young-generation collections (measured with gc.DEBUG_SAVEALL).
        self._stopped = True


# Stripe's bound; the key is stored with the response and in the admission event.
MAX_IDEMPOTENCY_KEY_CHARS = 255


def idempotency_key_of(value: str | None) -> str | None:
    """The Idempotency-Key header, refused if it is empty, longer than 255 characters or not
    printable ASCII (it is stored, and echoed in replays' logs)."""
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY_CHARS or not (
        value.isascii() and value.isprintable()
    ):
        raise ApiError(
            400,
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters",
            param="Idempotency-Key", code="invalid_value",
        )
    return value


def run_id_of(value: str | None) -> str | None:
    """The X-Tollgate-Run-Id header: the agent run a call belongs to (1-128 characters of
    letters, digits and . _ : -, starting with a letter or digit), or a 400 naming it."""
    if value is None:
        return None
    if not RUN_ID.fullmatch(value):
        raise ApiError(
            400, f"X-Tollgate-Run-Id must match {RUN_ID.pattern}", param="X-Tollgate-Run-Id",
            code="invalid_value",
        )
    return value


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def render_rows(
    rows: list[dict[str, Any]], fmt: str, columns: tuple[str, ...], request_id: str
) -> Response:
    headers = {"X-Request-Id": request_id}
    if fmt == "csv":
        return Response(to_csv(rows, columns), 200, headers, media_type="text/csv")
    return json_response(200, {"data": rows}, headers)




def _int_header(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
