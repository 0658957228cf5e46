"""Client CPU per streamed chat request: aiohttp (VLLMReplica) vs httpx.AsyncClient.

The simulated replica runs in its own process so that only the client's CPU is counted.
Run: .venv/bin/python -m bench.upstream_client [--requests 400 --concurrency 16 --tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import httpx
import orjson

from engine_adapter.vllm_http import VLLMReplica, make_session

MODEL = "bench-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": "benchmark the upstream client please"}],
        "max_tokens": tokens,
        "ignore_eos": True,
    }


async def _aiohttp_run(url: str, n: int, conc: int, tokens: int) -> int:
    chunks = 0
    async with make_session() as session:
        replica = VLLMReplica("b", url, MODEL, session)
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            nonlocal chunks
            async with sem:
                async for _ in replica.stream_chat(
                    _body(tokens), request_id=f"a{i}", cache_salt="b"
                ):
                    chunks += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return chunks


async def _httpx_run(url: str, n: int, conc: int, tokens: int) -> int:
    chunks = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=conc)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            nonlocal chunks
            body = {
                **_body(tokens),
                "model": MODEL,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "cache_salt": "b",
            }
            async with (
                sem,
                client.stream(
                    "POST",
                    f"{url}/v1/chat/completions",
                    content=orjson.dumps(body),
                    headers={"Content-Type": "application/json", "X-Request-Id": f"h{i}"},
                ) as resp,
            ):
                buf = b""
                async for data in resp.aiter_bytes():
                    frames = (buf + data).split(b"\n\n")
                    buf = frames.pop()
                    for f in frames:
                        if f == b"data: [DONE]":
                            return
                        if f.startswith(b"data: "):
                            orjson.loads(f[6:])
                            chunks += 1

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
    a = ap.parse_args()
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_adapter.simulated",
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
        _measure("aiohttp", _aiohttp_run, url, a.requests, a.concurrency, a.tokens)
        _measure("httpx", _httpx_run, url, a.requests, a.concurrency, a.tokens)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
