"""Several edges over one PostgreSQL store, flooded by one tenant: how far past its requests per
minute the tenant gets when each edge decides alone on its own view of the log.

Each edge (`tollgate api`, a simulated replica of its own) folds the log into its quota view
(api/runtime.py `_follow_log`: every 50 ms, no call on the admission path). So an edge over-admits
by at most what the other edges admit within one propagation delay (their commit, our read, our
loop's turn). Per run: `--edges` N edges, the tenant's limit set to `--rpm`, a flood of
`--concurrency` clients spread round-robin over the edges for `--duration` s. The tenant may get
rpm (the bucket starts full) + rpm × duration / 60 (its refill); admitted ÷ that is the figure.
`tollgate_admission_view_lag_seconds`, read from each edge's /metrics at the end, is the
propagation delay it saw last. Without the fold each edge would give the tenant its whole
minute: up to N times.

    python -m bench.edges [--edges 2,4] [--rpm 120] [--duration 10] [--concurrency 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.pipeline import fresh_schema

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3.1-8b-2026-05"
TENANT = "demo-standard"
TOLLGATE = [sys.executable, "-m", "api.cli"]
# The bound stated in api/README.md: the other edges' admissions within one propagation delay.
# As a ratio target at this flood: within 10 % of what the tenant may have.
TARGET_RATIO = 1.10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the edge exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def _lag(base: str) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.search(r"^tollgate_admission_view_lag_seconds ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


async def _flood(bases: list[str], key: str, duration: float, concurrency: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + duration
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def client(i: int) -> None:
            n = i
            while time.monotonic() < deadline:
                base = bases[n % len(bases)]
                n += 1
                try:
                    r = await c.post(f"{base}/v1/chat/completions", json=body, headers=headers)
                    status = str(r.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                counts[status] = counts.get(status, 0) + 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return counts


def one_run(edges: int, rpm: int, duration: float, concurrency: int, logs: Path) -> dict[str, Any]:
    with fresh_schema() as url:
        data = Path(tempfile.mkdtemp(prefix="bench-edges-", dir=logs))
        env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
        procs: list[subprocess.Popen[bytes]] = []
        bases: list[str] = []
        try:
            for i in range(edges):  # the first seeds the demo tenants; all serve them
                port = _free_port()
                args = [*TOLLGATE, "api", "--port", str(port), "--database-url", url,
                        "--simulated-replicas", "1", "--sim-speed", "50",
                        *(["--no-demo"] if i else [])]  # fmt: skip
                out = open(data / f"edge-{i}.log", "wb")  # noqa: SIM115 - the edge's own
                procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))  # fmt: skip
                bases.append(f"http://127.0.0.1:{port}")
                _wait(f"{bases[-1]}/healthz", procs[-1])
            key = json.loads((data / "demo-keys.json").read_text())[TENANT]
            subprocess.run(
                [*TOLLGATE, "limits", "set", "--tenant", TENANT, "--model", "*", "--rpm",
                 str(rpm), "--tpm", "100000000", "--database-url", url],
                cwd=ROOT, env=env, check=True, capture_output=True,
            )  # fmt: skip
            time.sleep(2.0)  # every edge's control follower has the limit (it polls at 0.2 s)
            started = time.monotonic()
            counts = asyncio.run(_flood(bases, key, duration, concurrency))
            took = time.monotonic() - started
            lags = [_lag(base) for base in bases]
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    allowed = rpm + rpm * took / 60
    admitted = counts.get("200", 0)
    return {
        "edges": edges,
        "flood_s": round(took, 2),
        "answers": counts,
        "admitted": admitted,
        "allowed": round(allowed, 1),
        "ratio": round(admitted / allowed, 3),
        "view_lag_s": [round(x, 3) if x is not None else None for x in lags],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", default="2,4")
    ap.add_argument("--rpm", type=int, default=120)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output", default="bench/results/edges.json")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-edges-"))
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    per_edges = {}
    for n in [int(x) for x in args.edges.split(",") if x]:
        runs = [one_run(n, args.rpm, args.duration, args.concurrency, logs)
                for _ in range(args.runs)]  # fmt: skip
        per_edges[str(n)] = {
            "ratio_median": statistics.median(r["ratio"] for r in runs),
            "over_admitted_median": statistics.median(r["admitted"] - r["allowed"] for r in runs),
            "runs": runs,
        }
        print(json.dumps(per_edges[str(n)], indent=2), flush=True)
    result = {
        "benchmark": "edges",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.edges", *sys.argv[1:]]),
        "uptime_before": uptime_before,
        "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "rpm": args.rpm,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "target_ratio": TARGET_RATIO,
        "edges": per_edges,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
