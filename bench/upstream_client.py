"""Client CPU per streamed chat request: Tollgate's own HTTP/1.1 client (VLLMReplica, chunks handed
to a sink as they arrive) vs aiohttp's ClientResponse.content vs httpx.AsyncClient; the same SSE
splitting and orjson parsing in all three.

The simulated replica runs in its own process so that only the client's CPU is counted.
Run: .venv/bin/python -m bench.upstream_client [--requests 400 --concurrency 16 --tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx
import orjson
import uvloop

from bench.common import free_port
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica, make_session

MODEL = "bench-model"


def _body(tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": "benchmark the upstream client please"}],
        "max_tokens": tokens,
        "ignore_eos": True,
    }


def _payload(tokens: int) -> bytes:
    return orjson.dumps(
        {
            **_body(tokens),
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "cache_salt": "b",
        }
    )


class _Sse:
    """The SSE splitting and parsing every client here does (as VLLMReplica does it)."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> int:
        frames = (self.buf + data).split(b"\n\n")
        self.buf = frames.pop()
        parsed = 0
        for f in frames:
            if f.startswith(b"data: {"):
                orjson.loads(f[6:])
                parsed += 1
        return parsed


async def _tollgate_run(url: str, n: int, conc: int, tokens: int) -> int:
    chunks = 0
    replica = VLLMReplica("b", url, MODEL)
    sem = asyncio.Semaphore(conc)

    def count(_: dict) -> None:
        nonlocal chunks
        chunks += 1

    async def one(i: int) -> None:
        async with sem:
            exchange = await replica.open_chat(_body(tokens), request_id=f"t{i}", cache_salt="b")
            await exchange.run(count)

    await asyncio.gather(*(one(i) for i in range(n)))
    replica.close()
    return chunks


async def _aiohttp_run(url: str, n: int, conc: int, tokens: int) -> int:
    chunks = 0
    async with make_session() as session:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            nonlocal chunks
            async with (
                sem,
                session.post(
                    f"{url}/v1/chat/completions",
                    data=_payload(tokens),
                    headers={"Content-Type": "application/json", "X-Request-Id": f"a{i}"},
                ) as resp,
            ):
                sse = _Sse()
                while data := await resp.content.readany():
                    chunks += sse.feed(data)

        await asyncio.gather(*(one(i) for i in range(n)))
    return chunks


async def _httpx_run(url: str, n: int, conc: int, tokens: int) -> int:
    chunks = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=conc)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            nonlocal chunks
            async with (
                sem,
                client.stream(
                    "POST",
                    f"{url}/v1/chat/completions",
                    content=_payload(tokens),
                    headers={"Content-Type": "application/json", "X-Request-Id": f"h{i}"},
                ) as resp,
            ):
                sse = _Sse()
                async for data in resp.aiter_bytes():
                    chunks += sse.feed(data)

        await asyncio.gather(*(one(i) for i in range(n)))
    return chunks


def _measure(name: str, fn, url: str, n: int, conc: int, tokens: int) -> None:
    asyncio.run(fn(url, min(n, 20), conc, tokens))  # warm-up
    cpu0, wall0 = time.process_time(), time.perf_counter()
    chunks = asyncio.run(fn(url, n, conc, tokens))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"{name:8s} {n} requests x {tokens} tokens, concurrency {conc}: "
        f"{cpu / n * 1000:.2f} ms CPU/request, {cpu / chunks * 1e6:.1f} us CPU/chunk, "
        f"wall {wall:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # as `tollgate serve` runs
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tollgate_llm.engine_adapter.simulator",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--step-base-ms",
            "0.5",
            "--per-seq-ms",
            "0.01",
            "--max-num-seqs",
            "256",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "simulated vLLM ... on http://..."
        url = f"http://127.0.0.1:{port}"
        for _ in range(a.rounds):  # interleaved: the machine's noise hits all three alike
            _measure("tollgate", _tollgate_run, url, a.requests, a.concurrency, a.tokens)
            _measure("aiohttp", _aiohttp_run, url, a.requests, a.concurrency, a.tokens)
            _measure("httpx", _httpx_run, url, a.requests, a.concurrency, a.tokens)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
