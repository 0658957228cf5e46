"""The Files and Batch API routes (OpenAI's paths and shapes): parse, call `BatchService`,
render. Customer keys only; every read is the caller's tenant's."""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and the
# customer dependency they name is this function's argument, not a module global.
import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from api.auth import Caller
from api.batch_service import MULTIPART_OVERHEAD_BYTES, BatchService
from api.chat_request import too_large
from api.errors import bad_request
from domain.batch import MAX_FILE_BYTES


def add_batch_routes(
    app: FastAPI,
    service: BatchService,
    customer: Any,
    render: Callable[[int, Any, dict[str, str]], Response],
) -> None:
    """`customer` is the app's customer-key dependency, `render(status, body, headers)` its
    JSON response."""
    CustomerDep = Annotated[Caller, Depends(customer)]  # noqa: N806 - a type alias

    def ids(request: Request) -> dict[str, str]:
        return {"X-Request-Id": request.state.request_id}

    @app.post("/v1/files")
    async def create_file(request: Request, caller: CustomerDep) -> Response:
        raw = await bounded_body(request, MAX_FILE_BYTES + MULTIPART_OVERHEAD_BYTES)
        found = await asyncio.to_thread(
            service.upload, caller, request.headers.get("content-type"), raw
        )
        return render(200, found, ids(request))

    # One route per path, its methods together: a 405 then names them all in its Allow.
    @app.api_route("/v1/files/{file_id}", methods=["GET", "DELETE"])
    async def one_file(request: Request, caller: CustomerDep, file_id: str) -> Response:
        act = service.delete if request.method == "DELETE" else service.file
        return render(200, await asyncio.to_thread(act, caller, file_id), ids(request))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, caller: CustomerDep, file_id: str) -> Response:
        content = await asyncio.to_thread(service.content, caller, file_id)
        return Response(content, 200, ids(request), media_type="application/jsonl")

    @app.api_route("/v1/batches", methods=["GET", "POST"])
    async def all_batches(
        request: Request, caller: CustomerDep, after: str | None = None, limit: str | None = None
    ) -> Response:
        if request.method == "POST":
            raw = await bounded_body(request, 64 * 1024)
            found = await asyncio.to_thread(service.create, caller, raw)
        else:
            found = await asyncio.to_thread(service.list, caller, after, _limit(limit))
        return render(200, found, ids(request))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, caller: CustomerDep, batch_id: str) -> Response:
        return render(200, await asyncio.to_thread(service.get, caller, batch_id), ids(request))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, caller: CustomerDep, batch_id: str) -> Response:
        found = await asyncio.to_thread(service.cancel, caller, batch_id)
        return render(200, found, ids(request))


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isascii() or not value.isdigit() or len(value) > 6:
        raise bad_request("'limit' must be an integer", "limit")
    return int(value)


async def bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 above `limit` bytes, before or while it is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
