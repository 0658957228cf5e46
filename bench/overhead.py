"""The edge's overhead at the compiled gateways' level (issue 31), in one run: the same mock
upstream reached directly, through Debian's nginx (a C proxy doing no work), through a bare
aiohttp pass-through (the Python floor), through Tollgate embedded (`tollgate serve`, its fold
worker included) and distributed (`tollgate api` on PostgreSQL with the relay, a Kafka worker
and the development broker), and through LiteLLM when its venv is there.

Closed loop with wrk at 1, 16 and 64 connections, JSON and 16-chunk streams, cells interleaved
across targets so the machine's noise hits all alike. Added latency is the open benchmark's
method: target p50/p99 − direct p50/p99, run by run, then the median over runs. CPU per request
is each target's own process tree (the upstream's is its own row), from /proc; the distributed
edge's beside its pipeline's. The load average is taken before every run.

Run: .venv/bin/python -m bench.overhead [--runs 3] [--duration 5] [--connections 1,16,64]
     [--gap-ms 0] [--no-litellm] [--no-distributed]
Writes bench/results/overhead.json (BENCHMARKS.md's "overhead" section).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, machine, uptime, write_result
from bench.gateway import closed_loop_once, med, paired_ratios, summarise
from bench.harness import (
    OUTPUT_TOKENS,
    Proc,
    body_for,
    litellm_version,
    post,
    start_distributed,
    start_floor,
    start_litellm,
    start_nginx,
    start_tollgate,
    start_upstream,
)

RESULTS = RESULTS_DIR / "overhead.json"
# The targets (ms; ratios), all measured in the same run as their reference.
ADDED_P99_MAX_MS = {1: 1.0, 16: 2.0}
CPU_MAX_MS = {"json": 0.55, "stream": 0.75}  # embedded, edge + fold worker, 16 connections
DISTRIBUTED_MAX_RATIO = 1.2  # distributed edge ÷ embedded edge, CPU per request


def _targets(
    args: argparse.Namespace, work: Path, procs: list[Proc], stack: contextlib.ExitStack
) -> tuple[dict[str, tuple[str, str, int]], dict[str, tuple[int, ...]], int, str]:
    upstream, up_url = start_upstream("cheap", args.gap_ms, work)
    procs.append(upstream)
    targets: dict[str, tuple[str, str, int]] = {"direct": (up_url, "", upstream.pid)}
    nginx, nginx_url = start_nginx(up_url, work)
    procs.append(nginx)
    targets["nginx"] = (nginx_url, "", nginx.pid)
    floor, floor_url = start_floor(up_url, work)
    procs.append(floor)
    targets["floor"] = (floor_url, "", floor.pid)
    tg, tg_url, tg_key = start_tollgate(up_url, work / "data", work)
    procs.append(tg)
    targets["tollgate"] = (tg_url, tg_key, tg.pid)
    pipeline: dict[str, tuple[int, ...]] = {}
    if not args.no_distributed:
        edge, edge_url, edge_key, _, pids = start_distributed(up_url, work, stack)
        procs.append(edge)
        targets["distributed"] = (edge_url, edge_key, edge.pid)
        pipeline["distributed"] = pids
    venv = Path(args.litellm_venv)
    if not args.no_litellm and (venv / "bin" / "litellm").exists():
        ll, ll_url, ll_key = start_litellm(venv, up_url, work)
        procs.append(ll)
        targets["litellm"] = (ll_url, ll_key, ll.pid)
    elif not args.no_litellm:
        print(f"LiteLLM not found in {venv}; skipping it", flush=True)
    for name, (url, key, _) in targets.items():
        for stream in (False, True):
            status, text = post(url + "/v1/chat/completions", body_for(stream), key)
            if status != 200:
                raise RuntimeError(f"{name} smoke request answered {status}: {text[:300]!r}")
    return targets, pipeline, upstream.pid, litellm_version(venv) if "litellm" in targets else ""


def _cell(
    raw: dict[tuple[str, str, int], list[dict[str, Any]]], target: str, mode: str, conns: int
) -> dict[str, Any]:
    runs = raw[(target, mode, conns)]
    out = summarise(runs)
    direct = raw[("direct", mode, conns)]
    for q in ("p50", "p99"):
        added = [t[f"{q}_ms"] - d[f"{q}_ms"] for t, d in zip(runs, direct, strict=True)]
        out[f"added_{q}_ms"] = med(added) if target != "direct" else None
        out[f"added_{q}_ms_runs"] = [round(a, 3) for a in added]
    return out


def _verdicts(
    cells: dict[str, Any], raw: dict[tuple[str, str, int], list[dict[str, Any]]],
    modes: list[str], conns: list[int],
) -> dict[str, Any]:  # fmt: skip
    verdicts: dict[str, Any] = {}
    tollgate = cells.get("tollgate", {})
    for mode in modes:
        for c, bound in ADDED_P99_MAX_MS.items():
            if c in conns:
                added = tollgate[mode][str(c)]["added_p99_ms"]
                verdicts[f"added_p99_{mode}_c{c}"] = {
                    "value_ms": added, "target": f"<= {bound}",
                    "met": bool(added <= bound) if added == added else None,
                }  # fmt: skip
        if 16 in conns:
            cpu = tollgate[mode]["16"]["cpu_ms_per_req"]
            floor = cells["floor"][mode]["16"]["cpu_ms_per_req"]
            verdicts[f"cpu_{mode}_c16"] = {
                "value_ms": cpu, "floor_ms": floor, "target": f"<= {CPU_MAX_MS[mode]}",
                "over_floor": round(cpu / floor, 2) if floor else None,
                "met": bool(cpu <= CPU_MAX_MS[mode]) if cpu == cpu else None,
            }  # fmt: skip
            if "distributed" in cells:
                paired = paired_ratios(raw, "distributed", "tollgate", mode, 16,
                                       "edge_cpu_ms_per_req")  # fmt: skip
                ratio = med(paired) if paired else float("nan")
                verdicts[f"distributed_{mode}_c16"] = {
                    "distributed_edge_ms": cells["distributed"][mode]["16"]["edge_cpu_ms_per_req"],
                    "embedded_edge_ms": tollgate[mode]["16"]["edge_cpu_ms_per_req"],
                    "ratio": ratio, "ratio_runs": [round(r, 3) for r in paired],
                    "target": f"<= {DISTRIBUTED_MAX_RATIO}",
                    "met": bool(ratio <= DISTRIBUTED_MAX_RATIO) if ratio == ratio else None,
                }  # fmt: skip
    return verdicts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the edge's overhead table (issue 31)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, default=1)
    ap.add_argument("--connections", default="1,16,64")
    ap.add_argument("--modes", default="json,stream")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="0: the mock answers at once")
    ap.add_argument("--litellm-venv", default="/tmp/litellm-venv")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--no-distributed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="1 run of 2 s per cell")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.duration, args.warmup = 1, 2, 0.5
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get update && apt-get install -y wrk")
    conns = [int(c) for c in args.connections.split(",")]
    modes = args.modes.split(",")
    work = Path(tempfile.mkdtemp(prefix="tollgate-bench-overhead-"))
    procs: list[Proc] = []
    stack = contextlib.ExitStack()
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "upstream": {"kind": "cheap", "gap_ms": args.gap_ms, "output_tokens": OUTPUT_TOKENS},
        "runs": args.runs,
        "duration_s": args.duration,
        "connections": conns,
        "uptime_before": uptime(),
    }
    try:
        targets, pipeline, upstream_pid, ll_version = _targets(args, work, procs, stack)
        result["targets_served"] = list(targets)
        if ll_version:
            result["litellm_version"] = ll_version
        print(f"targets up: {', '.join(f'{k}={v[0]}' for k, v in targets.items())}", flush=True)
        raw: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        loads: list[list[float]] = []
        for run in range(args.runs):
            loads.append([round(x, 2) for x in os.getloadavg()])
            for mode in modes:
                for c in conns:
                    for name, (url, key, pid) in targets.items():  # interleaved: same noise
                        r = closed_loop_once(
                            name, url, key, pid, upstream_pid, mode == "stream", c,
                            args.duration, args.warmup, pipeline.get(name, ()),
                        )  # fmt: skip
                        raw.setdefault((name, mode, c), []).append(r)
                        print(
                            f"run {run + 1}/{args.runs} {name:11s} {mode:6s} c={c:<3d} "
                            f"{r['rps']:8.1f} req/s p50 {r['p50_ms']:7.2f} p99 {r['p99_ms']:7.2f}"
                            f" ms cpu {r['cpu_ms_per_req'] or float('nan'):6.3f} ms/req "
                            f"err {r['error_total']} {r['non_2xx'] or ''}",
                            flush=True,
                        )
        cells: dict[str, Any] = {}
        for name in targets:
            for mode in modes:
                for c in conns:
                    cells.setdefault(name, {}).setdefault(mode, {})[str(c)] = _cell(
                        raw, name, mode, c
                    )
        result["cells"] = cells
        result["load_average_per_run"] = loads
        result["verdicts"] = _verdicts(cells, raw, modes, conns)
    except BaseException as exc:
        result["aborted"] = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        stack.close()
        result["uptime_after"] = uptime()
        result["logs"] = str(work)
        write_result(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
