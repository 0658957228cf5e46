"""Cost of parsing one vLLM /metrics scrape: prometheus_client's parser vs parse_metrics.

Run: .venv/bin/python -m bench.upstream_metrics
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import start_simulated_replica
from tollgate_llm.engine_adapter.vllm_http import parse_metrics


async def _scrape_text() -> bytes:
    h = await start_simulated_replica(SimConfig(step_base_ms=0.5))
    try:
        async with aiohttp.ClientSession() as s:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            for _ in range(20):
                await (await s.post(f"{h.url}/v1/chat/completions", json=body)).read()
            return await (await s.get(f"{h.url}/metrics")).read()
    finally:
        await h.stop()


def _per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    text = asyncio.run(_scrape_text())
    decoded = text.decode()
    lines = text.count(b"\n")
    prom = _per_call_us(lambda: list(text_string_to_metric_families(decoded)), 300)
    ours = _per_call_us(lambda: parse_metrics(text), 3000)
    print(f"/metrics: {len(text)} bytes, {lines} lines")
    print(f"prometheus_client parser: {prom:8.1f} us/scrape")
    print(f"parse_metrics:            {ours:8.1f} us/scrape ({prom / ours:.0f}x faster)")
    share = f"{prom * 400 / 1e4:.1f}% vs {ours * 400 / 1e4:.2f}%"
    print(f"at 4 scrapes/s x 100 replicas: {share} of a core")


if __name__ == "__main__":
    main()
