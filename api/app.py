"""The ASGI app: the completions route served directly, the rest through FastAPI. Routes parse,
call a service, render; the rules live elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

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
    return TollgateApp(runtime, app)


class TollgateApp:
    """The ASGI application. `POST /v1/chat/completions` is served here directly: it is the hot
    path, and FastAPI's routing, dependency solving and middleware stack cost more CPU per request
    than the whole of admission (measured with py-spy, bench/gateway.py). Every other route goes
    through the FastAPI app."""

    def __init__(self, runtime: Runtime, api: FastAPI) -> None:
        self.runtime = runtime
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            await self.chat_completions(scope, receive, send)
        else:
            await self.api(scope, receive, send)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The few headers this route reads, from one dict (ASGI names are lower-case): Starlette's
        # Headers scans and decodes the whole list on every lookup.
        headers = dict(scope["headers"])
        request_id = new_request_id()
        runtime = self.runtime
        watch: _DisconnectWatch | None = None
        frames: Any = None
        try:
            if scope["method"] != "POST":
                raise ApiError(
                    405, "use POST for /v1/chat/completions", code="method_not_allowed",
                    headers={"Allow": "POST"},
                )
            caller = runtime.edge.authenticate(_header(headers, b"authorization"), CUSTOMER)
            raw = await read_body(
                receive, headers.get(b"content-length"), runtime.settings.max_body_bytes
            )
            if raw is None:
                return  # the client left while sending the body: nothing was admitted
            # From here a client disconnect cancels this task: the edge records the
            # cancellation and aborts the engine request (closing its stream).
            watch = _DisconnectWatch(receive)
            outcome = await runtime.edge.chat(
                caller,
                raw,
                request_id=request_id,
                idempotency_key=_header(headers, b"idempotency-key"),
                retry_count=_int_header(_header(headers, b"x-stainless-retry-count")),
            )
            if isinstance(outcome, JsonOutcome):
                response = Response(
                    outcome.body, outcome.status, outcome.headers, media_type="application/json"
                )
                await response(scope, receive, send)
                return
            frames = outcome.frames
            headers = [
                (k.lower().encode(), v.encode()) for k, v in outcome.headers.items()
            ] + _SSE_HEADERS
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if outcome.first:
                await send({"type": "http.response.body", "body": outcome.first, "more_body": True})
            async for frame in frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            frames = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if watch is None or not watch.fired:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the client left
        except ApiError as exc:
            headers = {"X-Request-Id": request_id, **exc.headers}
            await json_response(exc.status, exc.body(), headers)(scope, receive, send)
        except Exception:
            runtime.log.exception("unhandled error on /v1/chat/completions")
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


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes | None:
    """The request body, refused (413) above `limit` bytes before or while it is read; None if
    the client disconnects first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


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
