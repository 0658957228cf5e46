"""How an error is answered: always OpenAI's error body with the request's id, whether a route
raised it (`ApiError`), Starlette routed nowhere, FastAPI refused a parameter, the store went
away, or something unexpected broke."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from tollgate_llm.api.http.deps import json_response
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.errors import (
    STORE_AWAY_ERRORS,
    ApiError,
    error_body,
    store_unavailable,
)
from tollgate_llm.ledger.ids import new_request_id


def add_error_handlers(app: FastAPI, runtime: Runtime) -> None:
    app.exception_handler(ApiError)(api_error)
    _add_client_errors(app)
    _add_server_errors(app, runtime)


async def api_error(request: Request, exc: ApiError) -> Response:
    headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
    headers.update(exc.headers)
    return json_response(exc.status, exc.body(), headers)


def _add_client_errors(app: FastAPI) -> None:
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
        return await api_error(request, answer)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        answer = ApiError(400, f"invalid {param or 'request'}: {first.get('msg', '')}",
                          param=param, code="invalid_value")  # fmt: skip
        return await api_error(request, answer)


def _add_server_errors(app: FastAPI, runtime: Runtime) -> None:
    async def _store_away(request: Request, exc: Exception) -> Response:
        answer = store_unavailable(exc)
        if answer is None:  # a database error that is not about reaching it: a bug
            return await _unexpected(request, exc)
        runtime.log.warning("store unavailable on %s: %s", request.url.path, exc)
        return await api_error(request, answer)

    # Registered per class, not only through the Exception handler below: Starlette re-raises
    # what that one answers, and the server then logs it as a crash (and may drop the
    # connection) for what is a database restart.
    for error in STORE_AWAY_ERRORS:
        app.add_exception_handler(error, _store_away)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        answer = store_unavailable(exc)  # raised from a store error, wrapped on the way
        if answer is not None:
            return await api_error(request, answer)
        runtime.log.exception("unhandled error on %s", request.url.path)
        headers = {"X-Request-Id": getattr(request.state, "request_id", "") or new_request_id()}
        return json_response(
            500, error_body("internal error", "server_error", None, "internal_error"), headers
        )
