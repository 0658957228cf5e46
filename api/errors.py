"""OpenAI-shaped error bodies and the one exception routes raise to produce them."""

from __future__ import annotations

from typing import Any

import orjson

# Error messages are echoed to the client and copied into refusal events; some quote a value the
# client sent (an unknown model, a tenant name). Bounded here, once, whatever the caller built.
MAX_MESSAGE_CHARS = 1_024


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
