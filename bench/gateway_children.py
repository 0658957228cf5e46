"""The processes `python -m bench.gateway` starts as children of a run: the cheap upstream
(`upstream`: vLLM's SSE shape from pre-rendered frames), the bare aiohttp pass-through (`floor`:
the least a Python proxy can do per request), the open-loop generator (`openloop`: sends on a
fixed schedule, latency from the scheduled time) and the OTLP sink of the tracing target
(`otlp-sink`: accepts every trace export, counts its spans, keeps nothing)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from bench.harness import OUTPUT_TOKENS

# --- the cheap upstream -----------------------------------------------------------------------


def _render_frames(model: str, *, include_usage: bool, continuous: bool) -> list[bytes]:
    import orjson

    prompt = 17
    frames = []
    base = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": model,
    }
    for i in range(OUTPUT_TOKENS):
        delta: dict[str, Any] = {"content": f" tok{i}"}
        if i == 0:
            delta = {"role": "assistant", "content": " tok0"}
        chunk: dict[str, Any] = {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": "length" if i == OUTPUT_TOKENS - 1 else None,
                }
            ],
        }
        if continuous:
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + i + 1,
                "completion_tokens": i + 1,
            }
        frames.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if include_usage:
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + OUTPUT_TOKENS,
            "completion_tokens": OUTPUT_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        frames.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def _completion_json(model: str) -> bytes:
    import orjson

    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1767225600,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(f" tok{i}" for i in range(16)),
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 17,
                "total_tokens": 33,
                "completion_tokens": 16,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )


def _metrics_text(model: str) -> bytes:
    lab = f'engine="0",model_name="{model}"'
    lines = [
        f"vllm:num_requests_running{{{lab}}} 0.0",
        f"vllm:num_requests_waiting{{{lab}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
        f"vllm:num_preemptions_total{{{lab}}} 0.0",
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1048576"} 1.0',
    ]
    for le in ("0.01", "0.025", "0.05", "0.075", "0.1", "+Inf"):
        lines.append(f'vllm:request_time_per_output_token_seconds_bucket{{{lab},le="{le}"}} 0.0')
    lines.append(f"vllm:request_time_per_output_token_seconds_count{{{lab}}} 0.0")
    lines.append(f"vllm:request_time_per_output_token_seconds_sum{{{lab}}} 0.0")
    return ("\n".join(lines) + "\n").encode()


def serve_upstream(port: int, model: str, gap_ms: float) -> None:
    import orjson
    from aiohttp import web

    variants = {
        (inc, cont): _render_frames(model, include_usage=inc, continuous=cont)
        for inc in (False, True)
        for cont in (False, True)
    }
    completion = _completion_json(model)
    metrics = _metrics_text(model)
    gap = gap_ms / 1000.0

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        loop = asyncio.get_running_loop()
        start = loop.time()
        if not body.get("stream"):
            if gap:
                await asyncio.sleep(gap * OUTPUT_TOKENS)
            return web.Response(body=completion, content_type="application/json")
        opts = body.get("stream_options") or {}
        frames = variants[
            (bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats")))
        ]
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            if gap and i < OUTPUT_TOKENS:
                # Token i is ready at start + (i + 1) gaps, as in the JSON answer, which is sent
                # when the last one is: sleeping a gap after each write instead let the timer's
                # overshoot pile up over 16 sleeps and made streams ~1-4 ms slower than JSON.
                await asyncio.sleep(max(0.0, start + (i + 1) * gap - loop.time()))
            elif i < last:
                await asyncio.sleep(0)
            await resp.write(frame)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def models(request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": model,
                            "object": "model",
                            "created": 0,
                            "owned_by": "vllm",
                            "max_model_len": 32768,
                        }
                    ],
                }
            ),
            content_type="application/json",
        )

    async def metrics_h(request: web.Request) -> web.Response:
        return web.Response(body=metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics_h)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- the OTLP sink ----------------------------------------------------------------------------


def serve_otlp_sink(port: int) -> None:
    """An OTLP/HTTP trace receiver that answers every export as a collector does (200, an empty
    ExportTraceServiceResponse) and discards it, counting posts and spans (`GET /stats`), so
    the traced target pays the whole export, the POST included. Its own process, not below
    Tollgate's: its CPU is not counted as the gateway's."""
    import orjson
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    counts = {"posts": 0, "spans": 0, "bytes": 0}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        exported = ExportTraceServiceRequest.FromString(body)
        counts["posts"] += 1
        counts["bytes"] += len(body)
        counts["spans"] += sum(
            len(scope.spans) for rs in exported.resource_spans for scope in rs.scope_spans
        )
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stats(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(counts), content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)

# --- the aiohttp floor ------------------------------------------------------------------------


def serve_floor(port: int, upstream: str) -> None:
    """A bare aiohttp reverse proxy on uvloop: the body forwarded as it came, the answer relayed
    as it arrives (a stream chunk by chunk), over a kept-alive connection pool; no parsing, no
    authentication, no record. What a Python edge costs before it does any of its own work."""
    import aiohttp
    import uvloop
    from aiohttp import web

    target = upstream + "/v1/chat/completions"
    forward = {"Content-Type": "application/json"}
    sse = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    session: aiohttp.ClientSession | None = None

    async def start(app: web.Application) -> None:
        nonlocal session
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def stop(app: web.Application) -> None:
        if session is not None:
            await session.close()

    async def chat(request: web.Request) -> web.StreamResponse:
        assert session is not None
        body = await request.read()
        async with session.post(target, data=body, headers=forward) as up:
            if not up.content_type.startswith("text/event-stream"):
                return web.Response(
                    body=await up.read(), status=up.status, content_type=up.content_type
                )
            resp = web.StreamResponse(status=up.status, headers=sse)
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop()
    )


# --- the open-loop generator ------------------------------------------------------------------


async def open_loop(
    url: str, body: bytes, auth: str, rate: float, duration: float, stream: bool
) -> dict[str, Any]:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Bearer " + auth
    n = int(rate * duration)
    lat: list[float] = []
    statuses: Counter[str] = Counter()
    late: list[float] = []
    first_error: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(scheduled: float) -> None:
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] += 1
                    if resp.status == 200:
                        lat.append(loop.time() - scheduled)
            except Exception as exc:  # counted, never silent
                statuses[type(exc).__name__] += 1
                first_error.setdefault(type(exc).__name__, repr(exc)[:200])

        # warm the pool: a few connections before the clock starts
        await asyncio.gather(*(one(loop.time()) for _ in range(8)))
        lat.clear()
        statuses.clear()
        tasks = []
        t0 = loop.time() + 0.05
        for i in range(n):
            scheduled = t0 + i / rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(loop.time() - scheduled)
            tasks.append(asyncio.ensure_future(one(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = loop.time() - t0
    lat.sort()
    late.sort()

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000 if xs else float("nan")

    return {
        "offered_rps": rate,
        "sent": n,
        "ok": len(lat),
        "statuses": dict(statuses),
        "achieved_rps": round(len(lat) / elapsed, 1),
        "latency_ms": {
            "p50": pct(lat, 50),
            "p90": pct(lat, 90),
            "p99": pct(lat, 99),
            "p999": pct(lat, 99.9),
            "max": lat[-1] * 1000 if lat else float("nan"),
        },
        "send_lateness_ms": {"p50": pct(late, 50), "p99": pct(late, 99)},
        "stream": stream,
        "first_errors": first_error,
    }
