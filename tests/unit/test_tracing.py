"""Tracing (api/services/tracing.py): off without an endpoint, and then neither the SDK nor the
exporter is imported; a clear error when an endpoint is set without the packages; and, on, the
spans of a request through the edge over fakes, the traceparent the replica gets, the trace id on
the admission event and in the log records made meanwhile."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.unit.test_edge import CALLER, MODEL, Harness
from tollgate_llm.api.logs import JsonFormatter
from tollgate_llm.api.services import tracing
from tollgate_llm.api.services.tracing import Tracing, TracingUnavailable
from tollgate_llm.domain.requests.events import RequestAdmitted

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def test_without_an_endpoint_tracing_is_off_and_the_sdk_is_not_imported() -> None:
    # (FastAPI imports the OpenTelemetry API itself when it is installed; the SDK and the
    # exporter, with their thread, are ours to load, and only when tracing is on.)
    code = (
        "import sys, api.http.app, api.runtime, api.services.tracing\n"
        "assert api.services.tracing.from_env({'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT': ''}) is None\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_an_endpoint_without_the_packages_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with pytest.raises(TracingUnavailable, match=r"pip install 'tollgate-llm\[otel\]'"):
        tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})


def test_a_traced_request_has_its_spans_its_traceparent_and_its_trace_id() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = Tracing(provider)
    h = Harness()
    logged: list[logging.LogRecord] = []
    tracing._log_trace_ids()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record)

    keep = Keep()
    logging.getLogger("tollgate.test").addHandler(keep)

    async def t() -> None:
        trace = tracer.request({b"traceparent": f"00-{TRACE_ID}-{PARENT}-01".encode()}, "req_1")
        assert trace is not None
        trace.authenticated(trace.now(), CALLER.tenant_id)
        raw = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        out = await h.edge.chat(
            CALLER, raw, request_id="req_1", idempotency_key=None, retry_count=0, trace=trace
        )
        assert out.status == 200  # type: ignore[union-attr]
        logging.getLogger("tollgate.test").warning("during the request")
        trace.end(200)
        await asyncio.sleep(0)  # the terminal append's commit callback

    try:
        asyncio.run(t())
    finally:
        logging.getLogger("tollgate.test").removeHandler(keep)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "POST /v1/chat/completions", "authenticate", "admission", "route", "record admission",
        "engine", "terminal append",
    }  # fmt: skip
    root = spans["POST /v1/chat/completions"]
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT
    for span in spans.values():
        assert format(span.context.trace_id, "032x") == TRACE_ID
    assert spans["route"].parent.span_id == spans["admission"].context.span_id  # type: ignore[union-attr]
    assert spans["admission"].attributes["tollgate.admission.decision"] == "admitted"  # type: ignore[index]
    assert spans["route"].attributes["tollgate.replica"] == "replica-1"  # type: ignore[index]
    engine = spans["engine"]
    assert engine.attributes["gen_ai.usage.output_tokens"] > 0  # type: ignore[index,operator]
    # The replica was sent the engine span as its parent.
    assert h.replica.traceparents == [f"00-{TRACE_ID}-{engine.context.span_id:016x}-01"]
    # The admission event names the trace; the log record made meanwhile carries it.
    (admitted,) = [r.event for r in h.sink.store.read_stream("req_1")
                   if isinstance(r.event, RequestAdmitted)]  # fmt: skip
    assert admitted.trace_id == TRACE_ID
    (record,) = logged
    assert json.loads(JsonFormatter().format(record))["trace_id"] == TRACE_ID


def test_an_untraced_request_sends_no_traceparent_and_records_no_trace_id() -> None:
    h = Harness()

    async def t() -> None:
        await h.chat()

    asyncio.run(t())
    assert h.replica.traceparents == [None]
    (admitted,) = [r.event for r in h.sink.store.read_stream(f"req_{1:032x}")
                   if isinstance(r.event, RequestAdmitted)]  # fmt: skip
    assert admitted.trace_id == ""


def test_a_request_the_sampler_drops_is_served_untraced() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # parent-based: the client's unsampled trace stays unsampled
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    unsampled = {b"traceparent": f"00-{TRACE_ID}-{PARENT}-00".encode()}
    assert Tracing(provider).request(unsampled, "req_1") is None
    assert exporter.get_finished_spans() == ()
