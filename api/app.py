"""The FastAPI app factory. Routes parse, call a service, render; the rules live elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.chat_request import too_large
from api.edge import Caller, JsonOutcome, new_request_id
from api.errors import ApiError, error_body
from api.runtime import Runtime

T = TypeVar("T")
CUSTOMER = frozenset({"customer", "admin"})


def customer(request: Request) -> Caller:
    request.state.request_id = new_request_id()
    runtime: Runtime = request.app.state.runtime
    return runtime.edge.authenticate(request.headers.get("authorization"), CUSTOMER)


CustomerDep = Annotated[Caller, Depends(customer)]


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
                caller, raw, request_id=request.state.request_id,
                idempotency_key=request.headers.get("idempotency-key"),
                retry_count=retry_count,
            ),
        )
        if outcome is None:  # the client left before the first token; the edge recorded it
            return Response(status_code=499)
        if isinstance(outcome, JsonOutcome):
            return Response(outcome.body, outcome.status, outcome.headers,
                            media_type="application/json")
        return StreamingResponse(
            outcome.frames, headers={**outcome.headers, "Cache-Control": "no-cache"},
            media_type="text/event-stream",
        )

    @app.get("/v1/models")
    async def list_models(caller: CustomerDep) -> Response:
        return json_response(200, {"object": "list", "data": runtime.fleet_models()})

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response(200, {"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        problems = runtime.readiness_problems()
        status = 503 if problems else 200
        return json_response(status, {"status": "ready" if not problems else "not_ready",
                                      "problems": problems})

    @app.get("/metrics")
    async def metrics() -> Response:
        runtime.refresh_gauges()
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
    try:
        await task
    except (asyncio.CancelledError, ApiError):
        pass
    return None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _int_header(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
