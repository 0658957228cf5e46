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

The flood comes from the Python client (httpx, ~150 req/s here) and from wrk (one per edge,
thousands of requests a second, most of them refused): the faster the flood, the more the other
edges answer within one propagation delay, so the bound is checked at both. Admitted is the
store's count of the tenant's RequestAdmitted (`answered_200`, what the clients saw, beside it).

    python -m bench.edges [--edges 2,4] [--rpm 120] [--duration 10] [--concurrency 16] [--runs 3]
        [--clients httpx,wrk]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.common import ROOT, free_port, fresh_schema, uptime, write_result
from bench.harness import run_wrk
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import events

MODEL = "llama-3.1-8b-2026-05"
TENANT = "demo-standard"
TOLLGATE = [sys.executable, "-m", "tollgate_llm.cli"]
# The bound stated in api/README.md: the other edges' admissions within one propagation delay.
# As a ratio target at this flood: within 10 % of what the tenant may have.
TARGET_RATIO = 1.10


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


def _flood_wrk(bases: list[str], key: str, duration: float, concurrency: int) -> dict[str, int]:
    """The same flood from one wrk per edge at once (`concurrency` connections shared out): a
    few thousand requests a second, where the Python client above drives ~150."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    per_edge = max(1, concurrency // len(bases))
    with ThreadPoolExecutor(len(bases)) as pool:
        summaries = list(pool.map(
            lambda base: run_wrk(base, body, key, per_edge, duration), bases
        ))  # fmt: skip
    counts: dict[str, int] = {}
    for summary in summaries:
        refused = sum(summary["non_2xx"].values())
        failed = sum(v for k, v in summary["errors"].items() if k != "status")
        counts["200"] = counts.get("200", 0) + summary["requests"] - refused - failed
        for status, n in summary["non_2xx"].items():
            counts[status] = counts.get(status, 0) + n
        if failed:
            counts["socket_errors"] = counts.get("socket_errors", 0) + failed
    return counts


def _admitted_in_store(url: str, tenant: str) -> int:
    """The tenant's admissions as the store holds them (what the edges committed)."""
    engine = create_engine_from_url(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(
                sa.select(sa.func.count()).select_from(events).where(
                    events.c.tenant_id == tenant, events.c.type == "RequestAdmitted"
                )
            ).scalar_one())  # fmt: skip
    finally:
        engine.dispose()


def one_run(
    edges: int, rpm: int, duration: float, concurrency: int, logs: Path, client: str = "httpx"
) -> dict[str, Any]:
    with fresh_schema() as url:
        data = Path(tempfile.mkdtemp(prefix="bench-edges-", dir=logs))
        env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
        procs: list[subprocess.Popen[bytes]] = []
        bases: list[str] = []
        try:
            for i in range(edges):  # the first seeds the demo tenants; all serve them
                port = free_port()
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
            if client == "wrk":
                counts = _flood_wrk(bases, key, duration, concurrency)
            else:
                counts = asyncio.run(_flood(bases, key, duration, concurrency))
            took = time.monotonic() - started
            lags = [_lag(base) for base in bases]
            stored = _admitted_in_store(url, TENANT)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    allowed = rpm + rpm * took / 60
    # What the store admitted: a wrk connection stopped mid-answer at the flood's end leaves an
    # admitted (then cancelled) request the client never counted as a 200.
    admitted = stored
    flood_rps = sum(counts.values()) / took
    known = [x for x in lags if x is not None]
    # The stated bound: what the other edges can admit within one propagation delay, at most
    # every request they answer in it (their share of the flood times the delay an edge saw).
    bound = (edges - 1) / edges * flood_rps * max(known, default=0.0)
    return {
        "edges": edges,
        "client": client,
        "flood_s": round(took, 2),
        "answers": counts,
        "admitted": admitted,
        "answered_200": counts.get("200", 0),
        "allowed": round(allowed, 1),
        "ratio": round(admitted / allowed, 3),
        "over_admitted": round(admitted - allowed, 1),
        "bound": round(bound, 1),
        "within_bound": admitted - allowed <= bound,
        "view_lag_s": [round(x, 3) if x is not None else None for x in lags],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", default="2,4")
    ap.add_argument("--rpm", type=int, default=120)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--clients", default="httpx,wrk",
        help="flood clients, each run in turn: httpx (~150 req/s), wrk (thousands)",
    )
    ap.add_argument("--output", default="bench/results/edges.json")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-edges-"))
    uptime_before = uptime()
    floods = []
    for client in args.clients.split(","):
        for n in [int(x) for x in args.edges.split(",") if x]:
            runs = [one_run(n, args.rpm, args.duration, args.concurrency, logs, client)
                    for _ in range(args.runs)]  # fmt: skip
            floods.append({
                "client": client,
                "edges": n,
                "ratio_median": statistics.median(r["ratio"] for r in runs),
                "over_admitted_median": statistics.median(r["over_admitted"] for r in runs),
                "bound_median": statistics.median(r["bound"] for r in runs),
                "within_bound_every_run": all(r["within_bound"] for r in runs),
                "runs": runs,
            })  # fmt: skip
            print(json.dumps(floods[-1], indent=2), flush=True)
    result = {
        "benchmark": "edges",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.edges", *sys.argv[1:]]),
        "uptime_before": uptime_before,
        "uptime_after": uptime(),
        "rpm": args.rpm,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "target_ratio": TARGET_RATIO,
        "floods": floods,
    }
    write_result(args.output, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
