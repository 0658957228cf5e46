"""Every request body is bounded while it is read, per route, before any route code runs.

The routes read their bodies in different ways (FastAPI's `request.body()`, a multipart parser,
a form loop), and one that read the whole body before its own size check let three parallel
300 MiB bodies take an edge from 141 MiB to 1.9 GiB (issue 27, item 1). So the bound is one
ASGI step in front of all of them: a body declared larger than its route's limit is a 413 at
once, and one that grows past it while arriving is a 413 when it does; a body within its limit
is handed to the route whole. An edge holds at most the limit per request in flight. The chat
route is not behind this step: it reads its body itself with `read_body`, under
`Settings.max_body_bytes`, on its hot path.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson

from tollgate_llm.api.http.web import MAX_LOGIN_BODY
from tollgate_llm.api.services.batch_service import MULTIPART_OVERHEAD_BYTES
from tollgate_llm.api.services.chat_request import too_large
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.runs_service import MAX_BODY_BYTES as MAX_RUN_BODY_BYTES
from tollgate_llm.domain.batches.files import MAX_FILE_BYTES
from tollgate_llm.ledger.ids import new_request_id

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Any body a route does not name: the JSON bodies of the back office and the batch API.
DEFAULT_BODY_BYTES: Final = 64 * 1024
# (method, path pattern, bytes): the first that matches is the route's limit.
ROUTE_BODY_BYTES: Final[tuple[tuple[str, re.Pattern[str], int], ...]] = (
    ("POST", re.compile(r"/v1/files"), MAX_FILE_BYTES + MULTIPART_OVERHEAD_BYTES),
    ("POST", re.compile(r"/v1/runs(/[^/]+/end)?"), MAX_RUN_BODY_BYTES),
    ("POST", re.compile(r"/ui/(login|logout)"), MAX_LOGIN_BODY),
)


def body_limit(method: str, path: str) -> int:
    for route_method, pattern, limit in ROUTE_BODY_BYTES:
        if method == route_method and pattern.fullmatch(path):
            return limit
    return DEFAULT_BODY_BYTES


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


async def bounded(app: App, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve `scope` with its body read first, within its route's limit."""
    limit = body_limit(scope["method"], scope["path"])
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    try:
        body = await read_body(receive, declared, limit)
    except ApiError as exc:
        await _answer(send, exc)
        return
    if body is None:
        return  # the client left before its body arrived: nothing to answer
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    await app(scope, replay, send)


async def _answer(send: Send, exc: ApiError) -> None:
    body = orjson.dumps(exc.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", new_request_id().encode()),
        # The rest of the body is not read: the connection cannot carry another request.
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
