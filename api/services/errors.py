"""OpenAI-shaped error bodies and the one exception routes raise to produce them."""

from __future__ import annotations

from typing import Any

import orjson
import sqlalchemy as sa

from tollgate_llm.ledger.errors import StoreBusy, StoreUnavailable

# Error messages are echoed to the client and copied into refusal events; some quote a value the
# client sent (an unknown model, a tenant name). Bounded here, once, whatever the caller built.
MAX_MESSAGE_CHARS = 1_024
# When a client may try again after a 503 that names no other instant: a database restart
# refuses connections for about a second (pg_ctl restart, measured on the test's cluster).
RETRY_AFTER_S = 2


class ApiError(Exception):
    """An error answered to the client: status, OpenAI `type`, the field at fault and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        if status == 503 and "Retry-After" not in self.headers:
            # Every 503 is worth retrying and says when.
            self.headers = {**self.headers, "Retry-After": str(RETRY_AFTER_S)}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_frame(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An in-stream error object (after the first token the status is already sent)."""
    return b"data: " + orjson.dumps(error_body(message, type, None, code)) + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the field at fault; `code` as OpenAI's (invalid_type, invalid_value, ...)."""
    if code is None and param is not None:
        code = "invalid_value"
    return ApiError(400, message, param=param, code=code)


# What the store (or its driver, or the pool in front of it) raises when the database cannot be
# reached now: a restart, a network cut, a pool with no connection free. None is the client's
# fault or a bug: a retry later may well succeed, so the answer is a 503, never a 500.
STORE_AWAY_ERRORS: tuple[type[BaseException], ...] = (
    StoreUnavailable, StoreBusy, sa.exc.OperationalError, sa.exc.InterfaceError,
    sa.exc.TimeoutError, sa.exc.DBAPIError,
)  # fmt: skip


def store_unavailable(exc: BaseException) -> ApiError | None:
    """The 503 for `exc` if it (or what it was raised from) means the store is away, else None.
    The mapping of every route (api/http/app.py's handlers and the chat route): one place."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:
        if _store_away(cause):
            return ApiError(
                503, "the event store is unavailable; retry later", type="server_error",
                code="store_unavailable",
            )  # fmt: skip
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


def _store_away(exc: BaseException) -> bool:
    if isinstance(exc, (StoreUnavailable, StoreBusy, sa.exc.TimeoutError)):
        return True
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError)):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated
