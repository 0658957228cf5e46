"""Traces: `tollgate serve` with OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set exports each chat
request's spans over OTLP/HTTP, continuing the client's `traceparent` and handing the engine span
to the replica as its `traceparent`; support's replay names the trace. Without the variable
nothing is exported. The receiver is a small HTTP server in this test that decodes the protobuf
bodies with opentelemetry-proto (no collector)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.e2e.conftest import (
    FAST,
    MODEL,
    EngineReplica,
    Server,
    auth,
    poll,
    running_server,
    short_body,
)

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"


class Receiver:
    """An OTLP/HTTP trace receiver: every span POSTed to /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or "protobuf" not in self.headers["Content-Type"]:
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.posts += 1
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                service = resource.get("service.name")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "service": service,
                            "resource": resource,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                        })  # fmt: skip

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.stop()


def test_a_traced_request_exports_its_spans_and_the_replica_continues_the_trace(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
    with running_server(tmp_path_factory, "traced", [(MODEL, FAST)]) as server:
        secret = server.keys["demo-standard"]
        headers = {**auth(secret), "traceparent": TRACEPARENT}
        streamed = httpx.post(
            f"{server.base}/v1/chat/completions", headers=headers, timeout=30,
            json=short_body(tokens=12, stream=True, stream_options={"include_usage": True}),
        )  # fmt: skip
        assert streamed.status_code == 200, streamed.text
        request_id = streamed.headers["x-request-id"]
        usage = [json.loads(line[6:]) for line in streamed.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]  # fmt: skip

        names = {"POST /v1/chat/completions", "authenticate", "admission", "route",
                 "record admission", "engine", "stream", "terminal append"}  # fmt: skip
        poll("every span of the request", lambda: names <= {
            s["name"] for s in receiver.of_trace(TRACE_ID)
        }, timeout=20)  # fmt: skip
        spans = {s["name"]: s for s in receiver.of_trace(TRACE_ID)}
        root = spans["POST /v1/chat/completions"]
        # The client's trace is continued: the server span is a child of the client's span.
        assert root["parent"] == CLIENT_SPAN_ID
        assert root["service"] == "tollgate"
        assert root["attributes"]["tollgate.request_id"] == request_id
        assert root["attributes"]["http.response.status_code"] == 200
        assert root["attributes"]["tollgate.terminal"] == "completed"
        for name in names - {"POST /v1/chat/completions", "route"}:
            assert spans[name]["parent"] == root["span_id"], name
        assert spans["route"]["parent"] == spans["admission"]["span_id"]
        for name, span in spans.items():
            assert root["start"] <= span["start"] <= span["end"] <= root["end"], name

        admission = spans["admission"]["attributes"]
        assert admission["tollgate.admission.decision"] == "admitted"
        assert admission["tollgate.admission.quota"] == "admitted"
        assert admission["tollgate.admission.level"] == "organization"
        assert admission["tollgate.replica"] == "replica-0"
        route = spans["route"]["attributes"]
        assert route["tollgate.replica"] == "replica-0"
        assert route["tollgate.route.reason"] == "p2c below the ceiling"
        assert spans["authenticate"]["attributes"]["tollgate.tenant"] == "demo-standard"
        engine = spans["engine"]["attributes"]
        assert engine["tollgate.replica"] == "replica-0"
        assert engine["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
        assert engine["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
        assert engine["tollgate.ttft_ms"] >= 0
        assert spans["terminal append"]["attributes"]["tollgate.durable"] is True

        # The replica got the engine span as its traceparent: vLLM's spans join this trace.
        record = server.replicas[0].record(request_id)
        assert record is not None
        assert record["traceparent"] == f"00-{TRACE_ID}-{spans['engine']['span_id']}-01"

        # Support's replay names the trace.
        timeline = json.loads(server.cli("replay", request_id, "--json"))
        assert timeline["trace_id"] == TRACE_ID
        assert "trace " + TRACE_ID in server.cli("replay", request_id)

        # A refusal is traced too, with its decision; without a traceparent, a new trace.
        refused = httpx.post(
            f"{server.base}/v1/chat/completions", headers=auth(secret), timeout=30,
            json=short_body(model="no-such-model"),
        )  # fmt: skip
        assert refused.status_code == 404

        def refused_root() -> dict[str, Any] | None:
            with receiver.lock:
                return next((s for s in receiver.spans
                             if s["attributes"].get("tollgate.request_id")
                             == refused.headers["x-request-id"]), None)  # fmt: skip

        other = poll("the refused request's span", refused_root)
        assert other["trace_id"] != TRACE_ID and other["parent"] == ""
        assert other["attributes"]["http.response.status_code"] == 404


def test_without_the_endpoint_nothing_is_exported(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every other OTel variable as in the traced run (and an empty endpoint, which is unset).
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with running_server(tmp_path_factory, "untraced", [(MODEL, FAST)]) as server:
        secret = server.keys["demo-standard"]
        response = httpx.post(
            f"{server.base}/v1/chat/completions", timeout=30,
            headers={**auth(secret), "traceparent": TRACEPARENT}, json=short_body(),
        )  # fmt: skip
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        record = server.replicas[0].record(request_id)
        assert record is not None and record["traceparent"] == ""  # nothing forwarded
        timeline = json.loads(server.cli("replay", request_id, "--json"))
        assert timeline["trace_id"] is None
    # The server has stopped (an exporter, had there been one, flushes at the stop).
    assert receiver.posts == 0 and receiver.spans == []


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_continues_the_gateways_trace(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine side of item 3: vLLM (the CPU build the tests run, 0.32) started with
    `--otlp-traces-endpoint` at the same receiver exports its `llm_request` span into the
    client's trace, a child of the gateway's engine span. Its own engine (the session's has no
    tracing): one more start, 20-50 s here. vLLM exports over gRPC unless
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf (vllm/tracing/otel.py); it reads the
    `traceparent` it is sent only when tracing is on (else it drops the headers)."""
    from tests.vllm.engine import SERVED_NAME, VllmServer, engine_python, tiny_model

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    python = engine_python()
    tmp = tmp_path_factory.mktemp("traced-vllm")
    engine = VllmServer(
        python, tiny_model(python), tmp / "vllm.log",
        extra_args=("--otlp-traces-endpoint", receiver.endpoint),
        extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )  # fmt: skip
    engine.start()
    server = Server(tmp, [EngineReplica(SERVED_NAME, engine.url)])  # type: ignore[list-item]
    try:
        server.data_dir.mkdir(parents=True)
        server.cli("models", "register", "--model", SERVED_NAME,
                   "--hf-config", str(engine.model_dir / "config.json"))  # fmt: skip
        server.start()
        headers = {**auth(server.keys["demo-standard"]), "traceparent": TRACEPARENT}
        answer = httpx.post(
            f"{server.base}/v1/chat/completions", headers=headers, timeout=120,
            json=short_body(model=SERVED_NAME, tokens=6, stream=True,
                            stream_options={"include_usage": True}),
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        request_id = answer.headers["x-request-id"]
        usage = [json.loads(line[6:]) for line in answer.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]  # fmt: skip

        def both() -> bool:
            return {"engine", "llm_request"} <= {s["name"] for s in receiver.of_trace(TRACE_ID)}

        poll("the gateway's engine span and vLLM's llm_request span", both, timeout=60)
        spans = {s["name"]: s for s in receiver.of_trace(TRACE_ID)}
        gateway_engine, vllm = spans["engine"], spans["llm_request"]
        assert gateway_engine["service"] == "tollgate"
        # vLLM's own span, from its own process, in the client's trace under the gateway's
        # engine span: the traceparent the gateway forwarded is the one vLLM continued.
        assert vllm["resource"].get("vllm.instrumenting_module_name") == "vllm.llm_engine"
        assert vllm["service"] != "tollgate"
        assert vllm["trace_id"] == gateway_engine["trace_id"] == TRACE_ID
        assert vllm["parent"] == gateway_engine["span_id"]
        assert vllm["attributes"]["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
        assert vllm["attributes"]["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert request_id in vllm["attributes"]["gen_ai.request.id"]
    finally:
        server.stop()
        engine.stop()
