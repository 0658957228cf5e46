"""The CPU tracing adds to a chat request: the edge's whole path (`Edge.chat` over the fakes of
tests/fakes.py, a streamed answer read to its end) with tracing off and on, in one process,
interleaved rounds, CPU time of the process (every thread: the SDK's export thread included) per
request. On: the SDK's BatchSpanProcessor and the spans encoded as OTLP protobuf, as the OTLP/HTTP
exporter does before its POST (the POST itself, one per 512 spans, is left out: a socket write).
Sampled out: tracing on, and a client's trace its sampler dropped (the default sampler, parent
based, drops ours too).

    python -m bench.tracing [--requests 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from bench.common import RESULTS_DIR, machine, write_result
from tests import builders as b
from tests.fakes import FakeClock, FakeFleet, FakeIdempotency, FakeReplica, FakeSink, FixedTokens
from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.edge import Edge, StreamOutcome
from tollgate_llm.api.services.tracing import Tracing
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.quota import QuotaView

WARM_UP = 200
CALLER = Caller(b.KEY, b.TENANT, "customer", "standard", "salt-acme")


class EncodingExporter(SpanExporter):
    """What OTLPSpanExporter does short of the HTTP POST: encode the batch to protobuf."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializePartialToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def edge() -> tuple[Edge, FakeReplica]:
    control = ControlView()
    events = (b.tenant_registered(), b.key_issued(), b.price_set(effective_at=b.at(-60)),
              b.limits_set(rpm=10_000_000, tpm=10_000_000_000))  # fmt: skip
    for i, event in enumerate(events):
        stream = "prices-0" if i == 2 else "tenant-acme"
        control.apply(b.record(event, version=i + 1, seconds=-60, stream_id=stream))
    replica = FakeReplica("replica-1", b.MODEL)
    fleet = FakeFleet(replica)
    metrics = Metrics()
    metrics.models.known = frozenset(fleet.models())
    return Edge(
        control=control, quota=QuotaView(control.limits), fleet=fleet, events=FakeSink(),
        idempotency=FakeIdempotency(), metrics=metrics, tokens=lambda model: FixedTokens(),
        edge_id="edge-1", rng=random.Random(7), clock=FakeClock(b.at(0)),
    ), replica  # fmt: skip


RAW = orjson.dumps({"model": b.MODEL, "stream": True, "max_tokens": 16,
                    "messages": [{"role": "user", "content": "two words"}]})  # fmt: skip
HEADERS = {b"traceparent": b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
# A client's trace its sampler dropped (flags 00): the default parent-based sampler drops ours.
UNSAMPLED = {b"traceparent": b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}


async def requests(
    n: int, tracing: Tracing | None, start: int, headers: dict[bytes, bytes] = HEADERS
) -> None:
    """n streamed requests, each read to its end (a trace per request when tracing is on)."""
    e, replica = edge()
    for i in range(start, start + n):
        request_id = f"req_{i:032x}"
        trace = None if tracing is None else tracing.request(headers, request_id)
        if trace is not None:
            trace.authenticated(trace.now(), CALLER.tenant_id)
        out = await e.chat(
            CALLER, RAW, request_id=request_id, idempotency_key=None, retry_count=0, trace=trace
        )
        assert isinstance(out, StreamOutcome)
        if trace is not None:
            trace.stream_started()
        async for _ in out.frames:
            pass
        if trace is not None:
            trace.stream_ended()
            trace.end(200)
        replica.requests.clear()
        replica.traceparents.clear()


def cpu_us_per_request(
    n: int, tracing: Tracing | None, start: int, provider: Any,
    headers: dict[bytes, bytes] = HEADERS,
) -> float:  # fmt: skip
    """The process's CPU (every thread) for n requests and the export of their spans."""
    used = time.process_time()
    asyncio.run(requests(n, tracing, start, headers))
    if tracing is not None:
        provider.force_flush()  # the export thread's work for these requests, counted
    return (time.process_time() - used) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output", default=str(RESULTS_DIR / "tracing.json"))
    args = ap.parse_args(argv)
    exporter = EncodingExporter()
    provider = TracerProvider()
    # A queue that holds a whole round: the tight loop here outruns the export thread, and a
    # dropped span would be CPU not counted.
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=20 * args.requests))
    tracing = Tracing(provider)
    off: list[float] = []
    on: list[float] = []
    dropped: list[float] = []
    asyncio.run(requests(WARM_UP, None, 0))  # warm-up: imports, caches
    asyncio.run(requests(WARM_UP, tracing, WARM_UP))
    provider.force_flush()
    for r in range(args.rounds):
        base = (r + 1) * 4 * args.requests
        off.append(cpu_us_per_request(args.requests, None, base, provider))
        on.append(cpu_us_per_request(args.requests, tracing, base + args.requests, provider))
        dropped.append(cpu_us_per_request(
            args.requests, tracing, base + 2 * args.requests, provider, UNSAMPLED
        ))  # fmt: skip
    provider.shutdown()
    ratios = [b_ / a for a, b_ in zip(off, on, strict=True)]
    result: dict[str, Any] = {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "off_us_per_request": [round(x, 1) for x in off],
        "on_us_per_request": [round(x, 1) for x in on],
        "off_us_median": round(statistics.median(off), 1),
        "on_us_median": round(statistics.median(on), 1),
        "sampled_out_us_per_request": [round(x, 1) for x in dropped],
        "sampled_out_us_median": round(statistics.median(dropped), 1),
        "added_us_median": round(statistics.median(o - f for f, o in zip(off, on, strict=True)),
                                 1),
        "on_over_off_median": round(statistics.median(ratios), 3),
        "spans_exported": exporter.spans,
        "spans_per_request": round(exporter.spans / (args.rounds * args.requests + WARM_UP), 2),
    }
    write_result(args.output, result)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
