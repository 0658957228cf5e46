"""The ASGI app: the completions route served directly, the rest through FastAPI. Routes parse,
call a service, render; the rules live elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from tollgate_llm.api.http.admin_routes import add_admin_routes
from tollgate_llm.api.http.batch_routes import add_batch_routes
from tollgate_llm.api.http.billing_routes import add_billing_routes
from tollgate_llm.api.http.body_limits import bounded, read_body
from tollgate_llm.api.http.deps import (
    CUSTOMER,
    CustomerDep,
    authenticate,
    customer,
    json_response,
    key_caller,
)
from tollgate_llm.api.http.error_handlers import add_error_handlers
from tollgate_llm.api.http.feedback_routes import add_feedback_routes
from tollgate_llm.api.http.openapi import install as install_openapi
from tollgate_llm.api.http.ops_routes import add_ops_routes
from tollgate_llm.api.http.run_routes import add_run_routes
from tollgate_llm.api.http.schemas import ModelList, answers
from tollgate_llm.api.http.support_routes import add_support_routes
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.auth import Caller, single_authorization
from tollgate_llm.api.services.edge import JsonOutcome, StreamOutcome
from tollgate_llm.api.services.errors import ApiError, error_body, store_unavailable
from tollgate_llm.api.services.refusals import (
    REFUSED_STATUSES,
    RefusalLimits,
    refused_before_admission,
)
from tollgate_llm.domain.runs.state import RUN_ID
from tollgate_llm.ledger.ids import new_request_id

if TYPE_CHECKING:
    from tollgate_llm.api.services.tracing import RequestTrace


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

    add_error_handlers(app, runtime)

    @app.get(
        "/v1/models", summary="Models on sale, and the caller tenant's own LoRA adapters "
        "(`parent`: the base model serving one)",
        response_model=ModelList, responses=answers(401, 403, 429),
    )  # fmt: skip
    async def list_models(request: Request, caller: CustomerDep) -> Response:
        return json_response(
            200,
            {"object": "list", "data": runtime.fleet_models(caller)},
            {"X-Request-Id": request.state.request_id},
        )

    add_billing_routes(app, runtime)
    add_support_routes(app, runtime)
    add_feedback_routes(app, runtime)
    add_run_routes(app, runtime)
    add_ops_routes(app, runtime)
    add_batch_routes(app, runtime.batches, customer, json_response)
    add_admin_routes(
        app, runtime.admin, runtime.audit, key_caller, json_response,
        currency=runtime.settings.currency,
    )  # fmt: skip

    from tollgate_llm.api.http.web import add_web_routes  # the /ui pages (issue 4)

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
        call = _ChatCall(new_request_id())
        # Tracing on: this request's spans (api/services/tracing.py); off, None and nothing else.
        trace = call.trace = (
            None if self.tracing is None else self.tracing.request(headers, call.request_id)
        )
        call.started = 0 if trace is None else trace.now()
        try:
            await self._serve(call, headers, scope, receive, send)
        except asyncio.CancelledError:
            if call.dropped is not None and call.dropped():
                # A slow reader the edge cancelled, which then read nothing more: its connection
                # is aborted, since closing it would wait for the client to read the buffer.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                _abort_connection(send)
            elif call.watch is None or not call.watch.fired:
                raise
            else:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the client left
        except ApiError as exc:
            await self._refused(call, exc)(scope, receive, send)
        except Exception as exc:
            await self._failed(call, exc)(scope, receive, send)
        finally:
            if call.watch is not None:
                call.watch.stop()
            if call.frames is not None:  # left mid-stream: the edge cancels and bills what was sent
                with contextlib.suppress(BaseException):
                    await call.frames.aclose()
            if trace is not None:
                trace.end(call.status)

    async def _serve(
        self, call: _ChatCall, headers: dict[bytes, bytes], scope: Scope, receive: Receive,
        send: Send,
    ) -> None:  # fmt: skip
        """The request, from its method to its last byte; what fails is answered by the caller."""
        if scope["method"] != "POST":
            raise ApiError(
                405, "use POST for /v1/chat/completions", code="method_not_allowed",
                headers={"Allow": "POST"},
            )  # fmt: skip
        runtime, limits, trace = self.runtime, self.limits, call.trace
        batch_item = _header(headers, b"x-tollgate-batch-item") or ""
        caller = call.caller = self._authenticate(scope, headers, batch_item)
        if trace is not None:
            trace.authenticated(call.started, caller.tenant_id)
        idempotency_key = idempotency_key_of(_header(headers, b"idempotency-key"))
        raw = await read_body(
            receive, headers.get(b"content-length"), runtime.settings.max_body_bytes
        )
        if raw is None:
            return  # the client left while sending the body: nothing was admitted
        wait_s = limits.over_budget(caller.key_id, caller.tenant_id)
        resolve = functools.partial(runtime.edge.resolve_model, caller=caller)
        if wait_s and refused_before_admission(raw, resolve):
            call.caller = None  # answered without being counted again, or recorded
            runtime.metrics.rejected.labels("refusals", "any").inc()
            raise limits.throttled(wait_s)
        # From here a client disconnect cancels this task: the edge records the
        # cancellation and aborts the engine request (closing its stream).
        call.watch = _DisconnectWatch(receive)
        outcome = await runtime.edge.chat(
            caller,
            raw,
            request_id=call.request_id,
            idempotency_key=idempotency_key,
            retry_count=_int_header(_header(headers, b"x-stainless-retry-count")),
            run_id=run_id_of(_header(headers, b"x-tollgate-run-id")),
            batch_item=batch_item[:200],
            trace=trace,
            end_user=_header(headers, b"x-tollgate-end-user"),
        )
        if isinstance(outcome, JsonOutcome):
            call.status = outcome.status
            response = Response(
                outcome.body, outcome.status, outcome.headers, media_type="application/json"
            )
            await response(scope, receive, send)
        else:
            await _relay(call, outcome, send)

    def _authenticate(self, scope: Scope, headers: dict[bytes, bytes], batch_item: str) -> Caller:
        """The caller: the key's, or, for the batch runner, the key that created the batch."""
        runtime, limits = self.runtime, self.limits
        authorization = _header(headers, b"authorization")
        source = limits.source(scope.get("client"), _header(headers, b"x-forwarded-for"))
        if batch_item:
            on_behalf = _header(headers, b"x-tollgate-on-behalf-of") or ""
            return authenticate(runtime, limits, source, lambda: runtime.edge.auth.on_behalf(
                authorization, runtime.settings.batch_token, on_behalf,
            ))  # fmt: skip
        return authenticate(
            runtime, limits, source, lambda: runtime.edge.authenticate(authorization, CUSTOMER)
        )

    def _refused(self, call: _ChatCall, exc: ApiError) -> Response:
        """The answer to a request refused with an OpenAI-style error, counted for its key."""
        call.status = exc.status
        trace, caller = call.trace, call.caller
        if trace is not None and not trace.authenticated_at and exc.status in (401, 403, 429):
            trace.authenticated(call.started, None, str(exc.code or exc.type))
        if caller is not None and exc.status in REFUSED_STATUSES:
            self.limits.refused(caller.key_id, caller.tenant_id)
        headers = {"X-Request-Id": call.request_id, **exc.headers}
        return json_response(exc.status, exc.body(), headers)

    def _failed(self, call: _ChatCall, exc: Exception) -> Response:
        """The answer to an unexpected error: a 503 when the store was away, else a 500 (logged
        with its traceback)."""
        caller = call.caller
        ids = {"request_id": call.request_id, "tenant_id": caller and caller.tenant_id}
        answer = store_unavailable(exc)
        if answer is not None:
            call.status = answer.status
            self.runtime.log.warning(
                "store unavailable on /v1/chat/completions: %s", exc, extra=ids
            )
            headers = {"X-Request-Id": call.request_id, **answer.headers}
            return json_response(answer.status, answer.body(), headers)
        call.status = 500
        self.runtime.log.exception("unhandled error on /v1/chat/completions", extra=ids)
        return json_response(
            500, error_body("internal error", "server_error", None, "internal_error"),
            {"X-Request-Id": call.request_id},
        )  # fmt: skip


class _ChatCall:
    """What the chat route's error answers and clean-up need to know of one request: who called,
    whether the disconnect watch was started, the stream still being relayed, the status sent."""

    __slots__ = ("caller", "dropped", "frames", "request_id", "started", "status", "trace", "watch")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.trace: RequestTrace | None = None
        self.started = 0
        self.caller: Caller | None = None
        self.watch: _DisconnectWatch | None = None
        self.frames: Any = None
        self.dropped: Any = None
        self.status = 200


async def _relay(call: _ChatCall, outcome: StreamOutcome, send: Send) -> None:
    """Send a stream's frames as the edge yields them; `call.frames` is left set (to be closed)
    only when the stream did not reach its end."""
    call.frames = frames = outcome.frames
    call.dropped = outcome.dropped
    headers = [(k.lower().encode(), v.encode()) for k, v in outcome.headers.items()]
    if call.trace is not None:
        call.trace.stream_started()
    await send({"type": "http.response.start", "status": 200, "headers": headers + _SSE_HEADERS})
    if outcome.first:
        await send({"type": "http.response.body", "body": outcome.first, "more_body": True})
    async for frame in frames:
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    call.frames = None
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if call.trace is not None:
        call.trace.stream_ended()


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


def _int_header(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
