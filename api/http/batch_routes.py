"""The Files and Batch API routes (OpenAI's paths and shapes): parse, call `BatchService`,
render. Customer keys only; every read is the caller's tenant's."""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and the
# customer dependency they name is this function's argument, not a module global.
import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import Response

from tollgate_llm.api.http.schemas import (
    AUTHENTICATED,
    Batch,
    BatchCreateRequest,
    BatchList,
    File,
    FileDeleted,
    FileUpload,
    IntegerText,
    answers,
    request_body,
)
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.batch_service import MAX_LIST, MULTIPART_OVERHEAD_BYTES, BatchService
from tollgate_llm.api.services.chat_request import too_large
from tollgate_llm.domain.batches.files import MAX_FILE_BYTES

FileId = Annotated[str, Path(description="a file id")]
BatchId = Annotated[str, Path(description="a batch id")]


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

    @app.post(
        "/v1/files",
        summary="Upload a batch input file (JSONL, one request a line; at most 10 MiB and 5,000 "
        "lines). A bad line is a 400 naming it; nothing is stored then",
        response_model=File, responses=answers(*AUTHENTICATED, 413),
        openapi_extra=request_body(FileUpload, media_type="multipart/form-data"),
    )  # fmt: skip
    async def create_file(request: Request, caller: CustomerDep) -> Response:
        raw = await bounded_body(request, MAX_FILE_BYTES + MULTIPART_OVERHEAD_BYTES)
        found = await asyncio.to_thread(
            service.upload, caller, request.headers.get("content-type"), raw
        )
        return render(200, found, ids(request))

    # One route per method, each described apart; a 405 names every method of the path in its
    # Allow (app.py `_routing_error`).
    @app.get(
        "/v1/files/{file_id}", operation_id="retrieve_file",
        summary="A file of the caller's tenant",
        response_model=File, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def retrieve_file(request: Request, caller: CustomerDep, file_id: FileId) -> Response:
        return render(200, await asyncio.to_thread(service.file, caller, file_id), ids(request))

    @app.delete(
        "/v1/files/{file_id}", operation_id="delete_file",
        summary="Delete a file and its content at once",
        response_model=FileDeleted, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def delete_file(request: Request, caller: CustomerDep, file_id: FileId) -> Response:
        return render(200, await asyncio.to_thread(service.delete, caller, file_id), ids(request))

    @app.get(
        "/v1/files/{file_id}/content",
        summary="A file's content (an input file, or a batch's output or error file: one JSON "
        "object a line, keyed by custom_id)",
        response_class=Response,
        responses=answers(*AUTHENTICATED, 404, description="JSONL", media_type="application/jsonl"),
    )  # fmt: skip
    async def file_content(request: Request, caller: CustomerDep, file_id: FileId) -> Response:
        content = await asyncio.to_thread(service.content, caller, file_id)
        return Response(content, 200, ids(request), media_type="application/jsonl")

    @app.post(
        "/v1/batches", operation_id="create_batch",
        summary="Create a batch: its items run in the flex class, billed at the flex price",
        response_model=Batch, responses=answers(*AUTHENTICATED, 404, 413),
        openapi_extra=request_body(BatchCreateRequest),
    )  # fmt: skip
    async def create_batch(request: Request, caller: CustomerDep) -> Response:
        raw = await bounded_body(request, 64 * 1024)
        found = await asyncio.to_thread(service.create, caller, raw)
        return render(200, found, ids(request))

    @app.get(
        "/v1/batches", operation_id="list_batches", summary="The caller's batches, newest first",
        response_model=BatchList, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def list_batches(
        request: Request, caller: CustomerDep,
        after: Annotated[
            str | None, Query(description="the last batch id of the previous page")
        ] = None,
        limit: Annotated[
            int, Query(ge=1, le=MAX_LIST, description="default 20"), IntegerText
        ] = 20,
    ) -> Response:  # fmt: skip
        found = await asyncio.to_thread(service.list, caller, after, limit)
        return render(200, found, ids(request))

    @app.get(
        "/v1/batches/{batch_id}", summary="A batch, with its request counts and files",
        response_model=Batch, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def retrieve_batch(request: Request, caller: CustomerDep, batch_id: BatchId) -> Response:
        return render(200, await asyncio.to_thread(service.get, caller, batch_id), ids(request))

    @app.post(
        "/v1/batches/{batch_id}/cancel",
        summary="Cancel a batch: what runs stops (billed nothing), what completed stays billed",
        response_model=Batch, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def cancel_batch(request: Request, caller: CustomerDep, batch_id: BatchId) -> Response:
        found = await asyncio.to_thread(service.cancel, caller, batch_id)
        return render(200, found, ids(request))


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
