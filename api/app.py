"""The FastAPI app factory. Routes parse, call a service, render; the rules live elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.backoffice import (
    ENTRY_COLUMNS,
    FORMATS,
    GROUP_BY,
    INVOICE_COLUMNS,
    USAGE_COLUMNS,
    choice,
    parse_range,
    timeline_json,
    to_csv,
)
from api.chat_request import too_large
from api.edge import Caller, JsonOutcome, new_request_id, utcnow
from api.errors import ApiError, error_body
from api.runtime import Runtime

T = TypeVar("T")
CUSTOMER = frozenset({"customer", "admin"})
ALL_SCOPES = frozenset({"customer", "finance", "support", "admin"})


async def customer(request: Request) -> Caller:
    request.state.request_id = new_request_id()
    runtime: Runtime = request.app.state.runtime
    return runtime.edge.authenticate(request.headers.get("authorization"), CUSTOMER)


CustomerDep = Annotated[Caller, Depends(customer)]


async def any_key(request: Request) -> Caller:
    request.state.request_id = new_request_id()
    runtime: Runtime = request.app.state.runtime
    return runtime.edge.authenticate(request.headers.get("authorization"), ALL_SCOPES)


AnyKeyDep = Annotated[Caller, Depends(any_key)]


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def create_app(runtime: Runtime) -> FastAPI:
    app = FastAPI(title="Tollgate", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.runtime = runtime

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        headers.update(exc.headers)
        return json_response(exc.status, exc.body(), headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        runtime.log.exception("unhandled error on %s", request.url.path)
        headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        return json_response(
            500, error_body("internal error", "server_error", None, "internal_error"), headers
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, caller: CustomerDep) -> Response:
        raw = await read_limited(request, runtime.settings.max_body_bytes)
        retry_count = _int_header(request.headers.get("x-stainless-retry-count"))
        outcome = await race_disconnect(
            request,
            runtime.edge.chat(
                caller,
                raw,
                request_id=request.state.request_id,
                idempotency_key=request.headers.get("idempotency-key"),
                retry_count=retry_count,
            ),
        )
        if outcome is None:  # the client left before the first token; the edge recorded it
            return Response(status_code=499)
        if isinstance(outcome, JsonOutcome):
            return Response(
                outcome.body, outcome.status, outcome.headers, media_type="application/json"
            )
        return StreamingResponse(
            outcome.frames,
            headers={**outcome.headers, "Cache-Control": "no-cache"},
            media_type="text/event-stream",
        )

    @app.get("/v1/models")
    async def list_models(caller: CustomerDep) -> Response:
        return json_response(200, {"object": "list", "data": runtime.fleet_models()})

    @app.get("/v1/billing/usage")
    async def billing_usage(request: Request, caller: AnyKeyDep) -> Response:
        q = request.query_params
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, q.get("tenant"))
        start, end = parse_range(q.get("from"), q.get("to"), utcnow())
        group_by = choice(q.get("group_by"), GROUP_BY, "hour", "group_by")
        fmt = choice(q.get("format"), FORMATS, "json", "format")
        rows = await asyncio.to_thread(bo.usage, tenant, start, end, q.get("model"), group_by)
        columns = USAGE_COLUMNS + (("key_id",) if group_by == "key" else ())
        return render_rows(rows, fmt, columns, request.state.request_id)

    @app.get("/v1/billing/ledger")
    async def billing_ledger(request: Request, caller: AnyKeyDep) -> Response:
        q = request.query_params
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, q.get("tenant"))
        start, end = parse_range(q.get("from"), q.get("to"), utcnow())
        fmt = choice(q.get("format"), FORMATS, "json", "format")
        limit = _int_param(q.get("limit"), 1000, "limit")
        rows = await asyncio.to_thread(
            bo.entries, tenant, start, end, q.get("model"), limit, q.get("after")
        )
        return render_rows(rows, fmt, ENTRY_COLUMNS, request.state.request_id)

    @app.get("/v1/billing/invoices/{tenant}")
    async def billing_invoice(request: Request, tenant: str, caller: AnyKeyDep) -> Response:
        q = request.query_params
        bo = runtime.backoffice
        bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        fmt = choice(q.get("format"), FORMATS, "json", "format")
        invoice = await asyncio.to_thread(bo.invoice, tenant, q.get("period"), utcnow())
        if fmt == "csv":
            return render_rows(invoice["lines"], fmt, INVOICE_COLUMNS, request.state.request_id)
        return json_response(200, invoice, {"X-Request-Id": request.state.request_id})

    @app.get("/v1/billing/reconciliation")
    async def billing_reconciliation(request: Request, caller: AnyKeyDep) -> Response:
        q = request.query_params
        bo = runtime.backoffice
        if bo.billing_tenant(caller.scope, caller.tenant_id, None) is not None:
            raise ApiError(
                403,
                "the reconciliation report is for finance keys",
                type="permission_error",
                code="insufficient_scope",
            )
        start, end = parse_range(q.get("from"), q.get("to"), utcnow())
        report = await asyncio.to_thread(bo.reconciliation, start, end)
        return json_response(200, report, {"X-Request-Id": request.state.request_id})

    @app.get("/v1/requests/{request_id}/events")
    async def request_events(request: Request, request_id: str, caller: AnyKeyDep) -> Response:
        timeline = await asyncio.to_thread(
            runtime.backoffice.timeline, request_id, caller.scope, caller.tenant_id, utcnow()
        )
        return json_response(
            200, timeline_json(timeline), {"X-Request-Id": request.state.request_id}
        )

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response(200, {"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        problems, warnings = runtime.readiness()
        status = 503 if problems else 200
        return json_response(
            status,
            {
                "status": "ready" if not problems else "not_ready",
                "problems": problems,
                "warnings": warnings,
            },
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        runtime.refresh_gauges()
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    from api.web import add_web_routes  # the /ui pages (issue 4)

    add_web_routes(app, runtime)
    return app


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def race_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` until done or until the client disconnects, which cancels it (the edge records
    the cancellation and aborts the engine request). Returns None on disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await task
    return None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def render_rows(
    rows: list[dict[str, Any]], fmt: str, columns: tuple[str, ...], request_id: str
) -> Response:
    headers = {"X-Request-Id": request_id}
    if fmt == "csv":
        return Response(to_csv(rows, columns), 200, headers, media_type="text/csv")
    return json_response(200, {"data": rows}, headers)


def _int_param(value: str | None, default: int, name: str) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ApiError(
            400, f"'{name}' must be an integer", param=name, code="invalid_value"
        ) from None


def _int_header(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
