"""OpenTelemetry spans for each chat request, exported over OTLP/HTTP when the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set. Unset,
`from_env` answers None, neither the SDK nor the exporter is imported, and every hook on the
request path is one `is not None` test.

One request is one `RequestTrace`: the route's server span (continuing the client's W3C
`traceparent`) and its children, `authenticate`, `admission` (with a `route` per routing
attempt), `record admission`, `engine` (whose `traceparent` the replica gets, so vLLM's spans
are its children), `stream` and `terminal append`. The exporter, the sampler, the service name
and the resource are the SDK's, configured by the standard OTEL_* variables."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tollgate_llm.domain.capacity import Choice

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from tollgate_llm.engine_adapter.usage import Progress

__all__ = ["ENDPOINT_VARIABLES", "RequestTrace", "Tracing", "TracingUnavailable", "from_env"]

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# The trace id of the request being served, for the log lines it causes (`api/logs.py`'s
# `trace_id`); set only while tracing is on.
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)


class TracingUnavailable(RuntimeError):
    """An OTLP endpoint is set but the OpenTelemetry packages are not installed."""


def from_env(environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """Tracing as the standard variables ask (None: no endpoint, so no tracing at all)."""
    if not any(environ.get(name) for name in ENDPOINT_VARIABLES):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"{' or '.join(ENDPOINT_VARIABLES)} is set, but OpenTelemetry is not installed "
            f"({exc.name} is missing): pip install 'tollgate-llm[otel]', or unset the variable"
        ) from None
    # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) wins over ours.
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": "tollgate"})
    provider = TracerProvider(resource=resource)
    # Batched, in the SDK's thread: the request path only hands finished spans over.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _log_trace_ids()
    return Tracing(provider)


def _log_trace_ids() -> None:
    """Every log record made while a traced request is served carries its trace id (the JSON
    log's `trace_id`), background tasks it started included: they copy its context."""
    make = logging.getLogRecordFactory()
    if getattr(make, "with_trace_id", False):
        return

    def with_trace_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        trace_id = TRACE_ID.get()
        if trace_id is not None:
            record.trace_id = trace_id
        return record

    with_trace_id.with_trace_id = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(with_trace_id)


class Tracing:
    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("tollgate")
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._client = SpanKind.CLIENT

    def request(self, headers: Mapping[bytes, bytes], request_id: str) -> RequestTrace | None:
        """A chat request's trace: the client's `traceparent` (and `tracestate`) continued, a
        new trace otherwise (or if it is malformed: the W3C rule). None when the sampler
        (OTEL_TRACES_SAMPLER; by default every trace, or as its parent says) drops it: the
        request is then served untraced, which costs that one decision instead of ~190 µs of
        spans that are never recorded (bench/tracing.py)."""
        carrier = {}
        for name in (b"traceparent", b"tracestate"):
            value = headers.get(name)
            if value is not None:
                carrier[name.decode()] = value.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        root = self.tracer.start_span(
            "POST /v1/chat/completions", context=parent, kind=self._server,
            attributes={"http.request.method": "POST", "http.route": "/v1/chat/completions",
                        "tollgate.request_id": request_id},
        )  # fmt: skip
        return RequestTrace(self, root) if root.is_recording() else None

    def shutdown(self) -> None:
        """Export what is still batched, then stop (at the process's end)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. Every method is called only when tracing is on; the spans it opens
    are ended by the hook that sees their end, or by `end` (a request cut short)."""

    __slots__ = ("_admission", "_ctx", "_engine", "_stream", "_token", "authenticated_at",
                 "root", "tracing", "trace_id")  # fmt: skip

    def __init__(self, tracing: Tracing, root: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self.tracing = tracing
        self.root = root
        self._ctx = set_span_in_context(root)
        self.trace_id = format(root.get_span_context().trace_id, "032x")
        self._token = TRACE_ID.set(self.trace_id)
        self._admission: Span | None = None
        self._engine: Span | None = None
        self._stream: Span | None = None
        self.authenticated_at = 0  # when authentication ended (0: not yet)

    @staticmethod
    def now() -> int:
        return time.time_ns()

    def _child(self, name: str, start: int | None = None, parent: Span | None = None,
               **attributes: Any) -> Span:  # fmt: skip
        from opentelemetry.trace import set_span_in_context

        context = self._ctx if parent is None else set_span_in_context(parent)
        return self.tracing.tracer.start_span(
            name, context=context, start_time=start, attributes=attributes
        )

    # --- the route -----------------------------------------------------------------------------

    def authenticated(self, started: int, tenant_id: str | None, error: str = "") -> None:
        span = self._child("authenticate", started)
        self.authenticated_at = self.now()
        if tenant_id is not None:
            span.set_attribute("tollgate.tenant", tenant_id)
            self.root.set_attribute("tollgate.tenant", tenant_id)
        if error:
            span.set_attribute("tollgate.error", error)
        span.end()

    def end(self, status: int) -> None:
        """The response is over (or the client left): close what is still open."""
        for span in (self._stream, self._engine, self._admission):
            if span is not None and span.is_recording():
                span.set_attribute("tollgate.cut_short", True)
                span.end()
        self.root.set_attribute("http.response.status_code", status)
        if status >= 500:
            from opentelemetry.trace import StatusCode

            self.root.set_status(StatusCode.ERROR)
        self.root.end()
        with contextlib.suppress(ValueError):  # ended in another context than it began
            TRACE_ID.reset(self._token)

    # --- admission (api/services/edge.py, api/services/admission.py) ------------------------------

    def admitting(self) -> None:
        self._admission = self._child("admission")

    def quota_decided(self, decision: Any) -> None:
        """The quota and budget decision (`domain.admission.Admitted | Rejected`), and the level
        that took it: the one that refused, or the deepest governing an admission."""
        span = self._admission
        if span is None:
            return
        reserved = getattr(decision, "reserved", None)
        if hasattr(decision, "reason"):  # Rejected
            span.set_attribute("tollgate.admission.quota", "refused")
            span.set_attribute("tollgate.admission.reason", decision.reason)
            span.set_attribute("tollgate.admission.level", decision.level or "organization")
            if decision.dimension:
                span.set_attribute("tollgate.admission.dimension", decision.dimension)
            return
        level = "organization"
        if reserved is not None:
            level = ("run" if reserved.run_id else "project" if reserved.project_id
                     else "workspace" if reserved.workspace_id else "key")  # fmt: skip
        span.set_attribute("tollgate.admission.quota", "admitted")
        span.set_attribute("tollgate.admission.level", level)
        span.set_attribute("tollgate.reserved_tokens", decision.estimate.reserved_tokens)

    def routed(self, started: int, model: str, choice: object) -> None:
        """One routing attempt (a fallback model is another)."""
        span = self._child("route", started, self._admission, **{"tollgate.model": model})
        if isinstance(choice, Choice):
            span.set_attribute("tollgate.replica", choice.replica_id)
            span.set_attribute("tollgate.route.occupancy_ppm", choice.occupancy_ppm)
            span.set_attribute(
                "tollgate.route.reason",
                f"p2c below the ceiling, preempting {len(choice.preempt)} flex"
                if choice.preempt else "p2c below the ceiling",
            )  # fmt: skip
        else:
            from tollgate_llm.domain.admission_steps import capacity_detail

            span.set_attribute("tollgate.route.reason", capacity_detail(choice))  # type: ignore[arg-type]
        span.end()

    def admitted(self, answer: Any) -> None:
        """Admission's answer (`api.services.admission.Admitted | Refused`)."""
        span, self._admission = self._admission, None
        if span is None:
            return
        flight = getattr(answer, "flight", None)
        if flight is None:
            error = answer.error
            span.set_attribute("tollgate.admission.decision", "refused")
            span.set_attribute("tollgate.admission.code", str(error.code or error.type))
            span.set_attribute("http.response.status_code", error.status)
        else:
            span.set_attribute("tollgate.admission.decision", "admitted")
            span.set_attribute("tollgate.model", flight.model)
            span.set_attribute("tollgate.tier", flight.tier)
            span.set_attribute("tollgate.service_tier", flight.service_tier)
            span.set_attribute("tollgate.replica", flight.choice.replica_id)
        span.end()

    def on_admission(self, commands: tuple[Any, ...]) -> tuple[Any, ...]:
        """The admission's commands with this trace's id on its AdmitRequest: support's replay
        of the request names the trace (RequestAdmitted.trace_id)."""
        from tollgate_llm.domain.requests.decide import AdmitRequest

        return tuple(
            dataclasses.replace(c, trace_id=self.trace_id) if isinstance(c, AdmitRequest) else c
            for c in commands
        )

    def recorded_admission(self, started: int, ok: bool) -> None:
        span = self._child("record admission", started)
        span.set_attribute("tollgate.durable", ok)
        span.end()

    # --- the engine, the stream, the end (api/services/flights.py, api/http/app.py) ---------------

    def engine_opened(self, replica_id: str) -> str:
        """Open the engine span; its `traceparent`, for the request to the replica."""
        span = self._engine = self.tracing.tracer.start_span(
            "engine", context=self._ctx, kind=self.tracing._client,
            attributes={"tollgate.replica": replica_id},
        )  # fmt: skip
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def stream_started(self) -> None:
        self._stream = self._child("stream")

    def stream_ended(self) -> None:
        span, self._stream = self._stream, None
        if span is not None:
            span.end()

    def ended(self, p: Progress, terminal: str, durable: Any) -> None:
        """The request's terminal decision: the engine span ends with the engine's counts, and
        the terminal event's append is a span that ends when it is durable (or known not to
        be)."""
        span, self._engine = self._engine, None
        if span is not None:
            span.set_attribute("gen_ai.usage.input_tokens", p.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", p.completion_tokens)
            span.set_attribute("tollgate.cached_tokens", p.cached_tokens)
            if p.first_token_ns:
                span.set_attribute("tollgate.ttft_ms", p.ttft_ms)
                span.set_attribute("tollgate.tpot_us", p.tpot_us)
            if p.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", (p.finish_reason,))
            span.set_attribute("tollgate.terminal", terminal)
            span.end()
        self.root.set_attribute("tollgate.terminal", terminal)
        append = self._child("terminal append", None, None, **{"tollgate.terminal": terminal})
        if durable is None:
            append.end()
            return

        def done(future: Any) -> None:
            ok = not future.cancelled() and future.exception() is None and bool(future.result())
            append.set_attribute("tollgate.durable", ok)
            append.end()

        durable.add_done_callback(done)
