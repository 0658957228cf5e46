"""Gateway overhead: the same cheap upstream reached (a) directly, (b) through Tollgate and
(c) through the LiteLLM proxy, all in one run.

Closed loop: `wrk` (Debian) with bench/lua/post.lua, non-streaming and streaming, at 16 and 64
connections: requests/s, latency p50/p99, and the server's CPU ms per request from
/proc/PID/stat (utime+stime of the process, its live descendants and its reaped children,
before/after, divided by the requests wrk completed).
Open loop: a separate generator process (`python -m bench.gateway openloop`) fires on a fixed
schedule at an offered rate (200 req/s) and measures latency from the *scheduled* send time, so a
stalled server cannot hide its queue (no coordinated omission). Reported: Tollgate's added p99.

The upstream is `python -m bench.gateway upstream`: a minimal aiohttp server that speaks the
vLLM SSE shape (16 content chunks, then a usage chunk when asked, then [DONE]; continuous usage
when asked), non-streaming JSON, /health, /v1/models and a static vLLM /metrics. Every frame is
pre-rendered; each chunk is its own write, `--gap-ms` apart (default 1 ms: chunks arrive one by
one as they do from a real engine, instead of being coalesced into one read). Both modes follow
one token schedule: token i is ready at start + (i + 1) gaps; the JSON answer goes when the last
one is, a stream sends each when it is.
`--upstream sim` uses the simulated replica (engine_adapter.simulator) instead, for comparison.

Run: .venv/bin/python -m bench.gateway [--quick] [--runs 3] [--duration 10] [--no-litellm]
     [--profile]   (py-spy record of the edge and its fold worker under load; top functions
                    into the JSON)
Needs: `apt-get install -y wrk`; LiteLLM in a separate venv (default /tmp/litellm-venv,
`python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]' py-spy`).
Writes bench/results/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    ROOT,
    machine,
    write_result,
)
from bench.gateway_children import open_loop, serve_floor, serve_otlp_sink, serve_upstream
from bench.harness import (
    MODEL,
    OUTPUT_TOKENS,
    Proc,
    add_budget_path,
    baseline_checkout,
    body_for,
    commit_of,
    descendants,
    litellm_version,
    own_cpu_s,
    post,
    run_wrk,
    sink_counts,
    start_distributed,
    start_floor,
    start_litellm,
    start_nginx,
    start_otlp_sink,
    start_tollgate,
    start_upstream,
    thread_cpu_s,
    tree_cpu_s,
)

RESULTS = RESULTS_DIR / "gateway.json"
NAN = float("nan")

# Targets printed beside the figures (from the issue).
TARGET_CPU_RATIO = 10  # Tollgate CPU/request <= LiteLLM's / 10
TARGET_P99_ADDED_MS = 5.0  # at 200 req/s open loop
# A restructuring must not cost more than this of the CPU per request (issue 11), A/B in one run.
AB_MAX_RATIO = 1.05
# Issue 15: the gateway's CPU per request with a four-level path and budgets on, against a key
# of the organization in the same run.
BUDGETS_MAX_RATIO = 1.10
ISSUE_LITELLM_CPU_MS = {"json": 21.0, "stream": 50.0}
CALIBRATION_CPU_MS = {
    "bare aiohttp pass-through": {"json": 0.36, "stream": 0.49},
    "FastAPI + pydantic + aiohttp": {"json": 0.63, "stream": 1.5},
}


def closed_loop_once(
    target: str,
    url: str,
    auth: str,
    server_pid: int,
    upstream_pid: int,
    stream: bool,
    conns: int,
    seconds: float,
    warmup: float,
    pipeline_pids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """`pipeline_pids`: other processes that work for this target (the distributed mode's
    relay, worker and broker), measured beside it as `pipeline_cpu_ms_per_req`."""
    body = body_for(stream)
    if warmup > 0:
        run_wrk(url, body, auth, conns, warmup)

    def pipeline_cpu() -> float:
        return sum(tree_cpu_s(p) for p in pipeline_pids)

    cpu0, up0, own0, pipe0 = (
        tree_cpu_s(server_pid), tree_cpu_s(upstream_pid), own_cpu_s(server_pid), pipeline_cpu()
    )  # fmt: skip
    th0 = thread_cpu_s(server_pid)
    w = run_wrk(url, body, auth, conns, seconds)
    th1 = thread_cpu_s(server_pid)
    cpu1, up1, own1, pipe1 = (
        tree_cpu_s(server_pid), tree_cpu_s(upstream_pid), own_cpu_s(server_pid), pipeline_cpu()
    )  # fmt: skip
    n = max(1, w["requests"])
    # threads that ended during the run are in neither snapshot: their time shows in the total
    threads = {k: round((v - th0.get(k, 0.0)) * 1000 / n, 3) for k, v in th1.items()}
    threads = {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0}
    errors = sum(w["errors"].values())
    return {
        "requests": w["requests"],
        "errors": w["errors"],
        "error_total": errors,
        "non_2xx": w.get("non_2xx", {}),
        "rps": round(w["requests"] / (w["duration_us"] / 1e6), 1),
        "p50_ms": w["latency_us"]["p50"] / 1000,
        "p99_ms": w["latency_us"]["p99"] / 1000,
        # no request finished: CPU per request is undefined, not CPU / 1
        "cpu_ms_per_req": round((cpu1 - cpu0) * 1000 / n, 3) if w["requests"] else None,
        # the edge process alone, without its fold worker child (embedded mode)
        "edge_cpu_ms_per_req": round((own1 - own0) * 1000 / n, 3) if w["requests"] else None,
        "pipeline_cpu_ms_per_req": round((pipe1 - pipe0) * 1000 / n, 3) if w["requests"] else None,
        "upstream_cpu_ms_per_req": round((up1 - up0) * 1000 / n, 3),
        "server_cpu_cores": round((cpu1 - cpu0) / (w["duration_us"] / 1e6), 2),
        "server_thread_cpu_ms_per_req": threads,
    }


def open_loop_once(
    url: str, auth: str, rate: float, seconds: float, stream: bool, server_pid: int | None
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.gateway",
        "openloop",
        "--url",
        url + "/v1/chat/completions",
        "--body",
        json.dumps(body_for(stream)),
        "--auth",
        auth,
        "--rate",
        str(rate),
        "--duration",
        str(seconds),
    ]
    cpu0 = tree_cpu_s(server_pid) if server_pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"open-loop generator failed: {out.stderr[-2000:]}")
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if server_pid:
        result["cpu_ms_per_req"] = round(
            (tree_cpu_s(server_pid) - cpu0) * 1000 / max(1, result["ok"]), 3
        )
    return result


def med(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return round(statistics.median(xs), 3) if xs else float("nan")


def paired_ratios(
    raw_runs: dict[tuple[str, str, int], list[dict[str, Any]]], target: str, reference: str,
    mode: str, conns: int, field: str = "cpu_ms_per_req",
) -> list[float]:  # fmt: skip
    """`field` of `target` over `reference`, run by run. Each run's cells are back to back, so
    the ratio within a run shares its noise; the median of these ratios is an A/B figure (the
    ratio of two medians mixes runs measured minutes apart on a noisy machine)."""
    return [
        a[field] / b[field]
        for a, b in zip(
            raw_runs[(target, mode, conns)], raw_runs[(reference, mode, conns)], strict=True
        )
        if a[field] and b[field]
    ]


def tracing_verdicts(
    raw_runs: dict[tuple[str, str, int], list[dict[str, Any]]], closed: dict[str, Any],
    modes: list[str], conns: list[int],
) -> dict[str, Any]:  # fmt: skip
    """Tracing on ('traced') against off ('tollgate'), paired per run: the whole server (edge and
    fold worker) and the edge alone, where the spans are made and exported."""
    out: dict[str, Any] = {}
    for mode in modes:
        for c in conns:
            on, off = closed["traced"][mode][str(c)], closed["tollgate"][mode][str(c)]
            paired = paired_ratios(raw_runs, "traced", "tollgate", mode, c)
            edge = paired_ratios(raw_runs, "traced", "tollgate", mode, c, "edge_cpu_ms_per_req")
            added = [a["cpu_ms_per_req"] - b["cpu_ms_per_req"] for a, b in zip(
                raw_runs[("traced", mode, c)], raw_runs[("tollgate", mode, c)], strict=True
            ) if a["cpu_ms_per_req"] and b["cpu_ms_per_req"]]  # fmt: skip
            out[f"tracing_cpu_{mode}_c{c}"] = {
                "traced_ms": on["cpu_ms_per_req"], "plain_ms": off["cpu_ms_per_req"],
                "traced_edge_ms": on["edge_cpu_ms_per_req"],
                "plain_edge_ms": off["edge_cpu_ms_per_req"],
                "traced_over_plain_per_run": [round(r, 3) for r in paired],
                "traced_over_plain": med(paired) if paired else None,
                "edge_traced_over_plain": med(edge) if edge else None,
                "added_ms_per_run": [round(a, 3) for a in added],
                "added_ms": med(added) if added else None,
                "target": "(comparison)", "met": None,
            }  # fmt: skip
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "rps",
        "p50_ms",
        "p99_ms",
        "cpu_ms_per_req",
        "edge_cpu_ms_per_req",
        "pipeline_cpu_ms_per_req",
        "upstream_cpu_ms_per_req",
        "server_cpu_cores",
    )
    out: dict[str, Any] = {k: med([r.get(k) for r in runs]) for k in keys}
    out["errors_total"] = sum(r["error_total"] for r in runs)
    names = {k for r in runs for k in r.get("server_thread_cpu_ms_per_req", {})}
    out["server_thread_cpu_ms_per_req"] = {
        k: med([r.get("server_thread_cpu_ms_per_req", {}).get(k, 0.0) for r in runs]) for k in names
    }
    out["runs"] = runs
    return out


def profile_tollgate(
    pid: int, url: str, auth: str, stream: bool, seconds: float, py_spy: str, out_dir: Path
) -> dict[str, Any]:
    """py-spy record (raw collapsed stacks) of the edge and of each child process (the fold
    worker) while wrk loads Tollgate; top self and inclusive, per process."""
    mode = "stream" if stream else "json"
    pids = {"edge": pid, **{f"child-{c}": c for c in descendants(pid)}}
    spies = {}
    for name, p in pids.items():
        raw = out_dir / f"tollgate-{mode}-{name.split('-')[0]}.txt"
        cmd = [
            py_spy, "record", "--pid", str(p), "--duration", str(int(seconds)), "--rate", "100",
            "--format", "raw", "--threads", "--output", str(raw), "--nonblocking",
        ]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        spies[name] = (spy, raw)
    time.sleep(1.0)
    run_wrk(url, body_for(stream), auth, 16, seconds - 1.5)
    out: dict[str, Any] = {}
    for name, (spy, raw) in spies.items():
        _, err = spy.communicate(timeout=seconds + 60)
        key = "worker" if name.startswith("child") else name
        if not raw.exists():
            out[key] = {"error": err.decode(errors="replace")[-500:]}
        else:
            out[key] = _collapse(raw)
    return out


def _collapse(raw: Path) -> dict[str, Any]:
    """Top self and inclusive frames of a py-spy raw profile, in % of its samples."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        frames = stack.split(";")
        thread = "?"
        while frames and frames[0].startswith(("process", "thread")):
            if frames[0].startswith("thread"):  # "thread (TID): NAME"
                thread = frames[0].split(":", 1)[-1].strip()
                thread = "AnyIO worker" if thread.startswith("AnyIO") else thread
            frames = frames[1:]
        threads[thread] += c
        total += c
        if not frames:
            continue
        self_c[frames[-1]] += c
        for f in set(frames):
            incl[f] += c

    def top(c: Counter[str], n: int) -> list[list[Any]]:
        return [[f, round(100 * v / max(1, total), 1)] for f, v in c.most_common(n)]

    return {
        "samples": total,
        "raw": str(raw.relative_to(ROOT)) if raw.is_relative_to(ROOT) else str(raw),
        "threads_pct": top(threads, 10),
        "top_self_pct": top(self_c, 25),
        "top_inclusive_pct": top(incl, 40),
    }


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="gateway overhead: direct vs Tollgate vs LiteLLM")
    sub = ap.add_subparsers(dest="cmd")
    up = sub.add_parser("upstream", help="run the cheap vLLM-shaped upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--model", default=MODEL)
    up.add_argument("--gap-ms", type=float, default=1.0)
    sink = sub.add_parser("otlp-sink", help="run the OTLP/HTTP sink of the tracing target")
    sink.add_argument("--port", type=int, required=True)
    fl = sub.add_parser("floor", help="run the bare aiohttp pass-through")
    fl.add_argument("--port", type=int, required=True)
    fl.add_argument("--upstream", required=True)
    ol = sub.add_parser("openloop", help="one open-loop run; prints a JSON line")
    ol.add_argument("--url", required=True)
    ol.add_argument("--body", required=True)
    ol.add_argument("--auth", default="")
    ol.add_argument("--rate", type=float, default=200)
    ol.add_argument("--duration", type=float, default=15)
    ap.add_argument("--quick", action="store_true", help="1 run, short durations")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--connections", default="16,64")
    ap.add_argument("--rate", type=float, default=200, help="open-loop offered req/s")
    ap.add_argument("--rates", default="50,200", help="open-loop offered rates, in order")
    ap.add_argument("--open-duration", type=float, default=20)
    ap.add_argument("--upstream", choices=("cheap", "sim"), default="cheap")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="upstream gap between chunks")
    ap.add_argument("--litellm-venv", default="/tmp/litellm-venv")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--profile", action="store_true", help="py-spy Tollgate under load")
    ap.add_argument("--modes", default="json,stream")
    ap.add_argument("--no-open-loop", action="store_true")
    ap.add_argument("--closed-targets", default="", help="subset, e.g. tollgate (default all)")
    ap.add_argument("--output", default=str(RESULTS))
    ap.add_argument(
        "--baseline",
        default="",
        help="another checkout (with its own .venv) served beside this one as target "
        "'baseline', interleaved, for an A/B of Tollgate's CPU per request",
    )
    ap.add_argument(
        "--baseline-commit",
        default="",
        help="like --baseline, on a checkout of this commit built under the temp dir",
    )
    ap.add_argument(
        "--baseline2",
        default="",
        help="more checkouts, comma-separated, served as targets 'baseline2', 'baseline3', ... "
        "and paired with 'tollgate' like 'baseline' (an A/B against several commits in one run)",
    )
    ap.add_argument(
        "--budgets",
        action="store_true",
        help="also serve target 'budgets': a second `tollgate serve` whose key sits on a "
        "four-level path (organization, workspace, project, key) with limits and day and month "
        "budgets at every level; its CPU per request is paired with 'tollgate' (issue 15)",
    )
    ap.add_argument(
        "--distributed",
        action="store_true",
        help="also serve the distributed mode (one `tollgate api` edge on a fresh PostgreSQL "
        "schema, the relay, one Kafka worker, the development broker) as target 'distributed'; "
        "with --baseline, the baseline's too, as target 'baseline-distributed'",
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also serve target 'traced': a second `tollgate serve` with "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at a local OTLP sink that accepts every export and "
        "discards it; its CPU per request is paired with 'tollgate' (tracing off)",
    )
    ap.add_argument(
        "--floors",
        action="store_true",
        help="also serve the two floors in front of the same upstream: Debian's nginx as a plain "
        "reverse proxy (target 'nginx') and a bare aiohttp pass-through (target 'floor')",
    )
    args = ap.parse_args(argv)

    if args.cmd == "otlp-sink":
        serve_otlp_sink(args.port)
        return
    if args.cmd == "upstream":
        serve_upstream(args.port, args.model, args.gap_ms)
        return
    if args.cmd == "floor":
        serve_floor(args.port, args.upstream)
        return
    if args.cmd == "openloop":
        res = asyncio.run(
            open_loop(
                args.url,
                args.body.encode(),
                args.auth,
                args.rate,
                args.duration,
                bool(json.loads(args.body).get("stream")),
            )
        )
        print(json.dumps(res))
        return

    if args.baseline_commit and not args.baseline:
        args.baseline = str(baseline_checkout(args.baseline_commit))
    if args.quick:
        args.runs, args.duration, args.warmup, args.open_duration = 1, 4, 1, 8
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get update && apt-get install -y wrk")
    conns = [int(c) for c in args.connections.split(",")]
    venv = Path(args.litellm_venv)
    use_litellm = not args.no_litellm and (venv / "bin" / "litellm").exists()
    if not args.no_litellm and not use_litellm:
        print(f"LiteLLM not found in {venv}; skipping it (see the module docstring)", flush=True)

    work = Path(tempfile.mkdtemp(prefix="tollgate-bench-gw-"))
    procs: list[Proc] = []
    pipeline: dict[str, tuple[int, ...]] = {}  # target -> its pipeline's pids
    stack = contextlib.ExitStack()
    deaths: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "gateway",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.gateway " + " ".join(sys.argv[1:] if argv is None else argv),
        "upstream": {"kind": args.upstream, "gap_ms": args.gap_ms, "output_tokens": OUTPUT_TOKENS},
        "runs": args.runs,
        "duration_s": args.duration,
        "connections": conns,
        "targets": {
            "tollgate_cpu_per_req_max_fraction_of_litellm": 1 / TARGET_CPU_RATIO,
            "p99_added_ms_at_200rps_max": TARGET_P99_ADDED_MS,
        },
        "issue_reference_ms": {"litellm_1.108": ISSUE_LITELLM_CPU_MS, **CALIBRATION_CPU_MS},
    }
    try:
        upstream, up_url = start_upstream(args.upstream, args.gap_ms, work)
        procs.append(upstream)
        tg, tg_url, tg_key = start_tollgate(up_url, work / "data", work)
        procs.append(tg)
        targets = {"direct": (up_url, "", upstream.pid), "tollgate": (tg_url, tg_key, tg.pid)}
        if args.baseline:
            tree = Path(args.baseline).resolve()
            base, base_url, base_key = start_tollgate(
                up_url, work / "data-baseline", work, tree, "baseline"
            )
            procs.append(base)
            targets["baseline"] = (base_url, base_key, base.pid)
            result["baseline"] = {"tree": str(tree), "commit": commit_of(tree)}
        others = [Path(t).resolve() for t in args.baseline2.split(",") if t]
        for n, tree in enumerate(others, start=2):
            name = f"baseline{n}"
            base, base_url, base_key = start_tollgate(
                up_url, work / f"data-{name}", work, tree, name
            )
            procs.append(base)
            targets[name] = (base_url, base_key, base.pid)
            result[name] = {"tree": str(tree), "commit": commit_of(tree)}
        if args.budgets:
            bud, bud_url, _ = start_tollgate(up_url, work / "data-budgets", work, name="budgets")
            procs.append(bud)
            targets["budgets"] = (bud_url, add_budget_path(ROOT, work / "data-budgets"), bud.pid)
        if args.floors:
            nginx, nginx_url = start_nginx(up_url, work)
            procs.append(nginx)
            targets["nginx"] = (nginx_url, "", nginx.pid)
            floor, floor_url = start_floor(up_url, work)
            procs.append(floor)
            targets["floor"] = (floor_url, "", floor.pid)
        if args.distributed:
            edge, edge_url, edge_key, _, pids = start_distributed(up_url, work, stack)
            procs.append(edge)  # the relay and worker stop with `stack`
            targets["distributed"] = (edge_url, edge_key, edge.pid)
            pipeline["distributed"] = pids
            if args.baseline:  # the baseline's distributed mode too, for an A/B of it
                edge, edge_url, edge_key, _, pids = start_distributed(
                    up_url, work, stack, Path(args.baseline).resolve(), "baseline-distributed"
                )
                procs.append(edge)
                targets["baseline-distributed"] = (edge_url, edge_key, edge.pid)
                pipeline["baseline-distributed"] = pids
        if args.tracing:
            sink, sink_url = start_otlp_sink(work)
            procs.append(sink)
            traced_env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink_url + "/v1/traces"}
            tr, tr_url, tr_key = start_tollgate(up_url, work / "data-traced", work,
                                                name="traced", env_extra=traced_env)  # fmt: skip
            procs.append(tr)
            targets["traced"] = (tr_url, tr_key, tr.pid)
        if use_litellm:
            ll, ll_url, ll_key = start_litellm(venv, up_url, work)
            procs.append(ll)
            targets["litellm"] = (ll_url, ll_key, ll.pid)
            result["litellm_version"] = litellm_version(venv)
        for name, (url, key, _) in targets.items():
            for stream in (False, True):
                status, text = post(url + "/v1/chat/completions", body_for(stream), key)
                if status != 200:
                    raise RuntimeError(f"{name} smoke request answered {status}: {text[:300]!r}")
        print(f"targets up: {', '.join(f'{k}={v[0]}' for k, v in targets.items())}", flush=True)

        modes = args.modes.split(",")
        chosen = args.closed_targets.split(",") if args.closed_targets else list(targets)
        closed: dict[str, Any] = {t: {} for t in targets if t in chosen}
        raw_runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for run in range(args.runs):
            for mode in modes:
                for c in conns:
                    for name, (url, key, pid) in targets.items():  # interleaved: same noise
                        if name not in chosen:
                            continue
                        r = closed_loop_once(
                            name,
                            url,
                            key,
                            pid,
                            upstream.pid,
                            mode == "stream",
                            c,
                            args.duration,
                            args.warmup,
                            pipeline.get(name, ()),
                        )
                        raw_runs.setdefault((name, mode, c), []).append(r)
                        print(
                            f"run {run + 1}/{args.runs} {name:8s} {mode:6s} c={c:<3d} "
                            f"{r['rps']:8.1f} req/s p50 {r['p50_ms']:7.2f} ms p99 "
                            f"{r['p99_ms']:7.2f} ms cpu {r['cpu_ms_per_req'] or NAN:6.3f} ms/req "
                            f"(upstream {r['upstream_cpu_ms_per_req']:.3f}) err {r['error_total']} "
                            f"{r['non_2xx'] or ''}",
                            flush=True,
                        )
        for (name, mode, c), runs in raw_runs.items():
            closed[name].setdefault(mode, {})[str(c)] = summarise(runs)
        result["closed_loop"] = closed

        # open loop: direct vs Tollgate, interleaved, non-streaming and streaming, each rate.
        # Tollgate may not survive an offered rate above its capacity: it is restarted (fresh
        # data dir) before the next run if it died, and the death is recorded.
        open_res: dict[str, Any] = {}
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
        for rate in [] if args.no_open_loop else rates:
            for mode in modes:
                per: dict[str, list[dict[str, Any]]] = {"direct": [], "tollgate": []}
                for run in range(args.runs):
                    for name in ("direct", "tollgate"):
                        if name == "tollgate" and tg.p.poll() is not None:
                            deaths.append(
                                {
                                    "after": f"{mode} {rate:.0f} req/s run {run}",
                                    "returncode": tg.p.returncode,
                                }
                            )
                            print(f"tollgate exited ({tg.p.returncode}); restarting", flush=True)
                            tg, tg_url, tg_key = start_tollgate(
                                up_url, work / f"data-{len(deaths)}", work
                            )
                            procs.append(tg)
                            targets["tollgate"] = (tg_url, tg_key, tg.pid)
                        url, key, pid = targets[name]
                        r = open_loop_once(
                            url, key, rate, args.open_duration, mode == "stream", pid
                        )
                        per[name].append(r)
                        print(
                            f"open {run + 1}/{args.runs} {name:8s} {mode:6s} {rate:.0f} req/s: "
                            f"p50 {r['latency_ms']['p50']:.2f} p99 {r['latency_ms']['p99']:.2f} "
                            f"ms ok {r['ok']}/{r['sent']} {r['statuses']}",
                            flush=True,
                        )
                added = [
                    t["latency_ms"]["p99"] - d["latency_ms"]["p99"]
                    for d, t in zip(per["direct"], per["tollgate"], strict=True)
                ]
                added50 = [
                    t["latency_ms"]["p50"] - d["latency_ms"]["p50"]
                    for d, t in zip(per["direct"], per["tollgate"], strict=True)
                ]
                open_res.setdefault(mode, {})[f"{rate:.0f}"] = {
                    "offered_rps": rate,
                    "duration_s": args.open_duration,
                    "direct_p50_ms": med([r["latency_ms"]["p50"] for r in per["direct"]]),
                    "direct_p99_ms": med([r["latency_ms"]["p99"] for r in per["direct"]]),
                    "tollgate_p50_ms": med([r["latency_ms"]["p50"] for r in per["tollgate"]]),
                    "tollgate_p99_ms": med([r["latency_ms"]["p99"] for r in per["tollgate"]]),
                    "tollgate_ok_fraction": round(
                        sum(r["ok"] for r in per["tollgate"])
                        / max(1, sum(r["sent"] for r in per["tollgate"])),
                        3,
                    ),
                    "added_p50_ms": med(added50),
                    "added_p99_ms": med(added),
                    "added_p99_ms_runs": [round(a, 3) for a in added],
                    "tollgate_cpu_ms_per_req": med([r["cpu_ms_per_req"] for r in per["tollgate"]]),
                    "non_200": sum(
                        sum(v for k, v in r["statuses"].items() if k != "200")
                        for rs in per.values()
                        for r in rs
                    ),
                    "runs": per,
                }
        result["open_loop"] = open_res

        # verdicts
        verdicts: dict[str, Any] = {}
        if "litellm" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    t = closed["tollgate"][mode][str(c)]["cpu_ms_per_req"]
                    ll = closed["litellm"][mode][str(c)]["cpu_ms_per_req"]
                    verdicts[f"cpu_ratio_{mode}_c{c}"] = {
                        "tollgate_ms": t,
                        "litellm_ms": ll,
                        "litellm_over_tollgate": round(ll / t, 1) if t and ll == ll else None,
                        "target": f">= {TARGET_CPU_RATIO}",
                        # None: LiteLLM finished no request in that cell, nothing to compare
                        "met": bool(ll / t >= TARGET_CPU_RATIO) if t and ll == ll else None,
                    }
        for base_name in ("baseline", *(f"baseline{n}" for n in range(2, len(others) + 2))):
            prefix = "ab" + base_name.removeprefix("baseline")
            if base_name not in closed or "tollgate" not in closed:
                continue
            for mode in modes:
                for c in conns:
                    t = closed["tollgate"][mode][str(c)]["cpu_ms_per_req"]
                    base_ms = closed[base_name][mode][str(c)]["cpu_ms_per_req"]
                    paired = paired_ratios(raw_runs, "tollgate", base_name, mode, c)
                    ratio = med(paired) if paired else None
                    verdicts[f"{prefix}_cpu_{mode}_c{c}"] = {
                        "tollgate_ms": t,
                        "baseline_ms": base_ms,
                        "tollgate_over_baseline_per_run": [round(r, 3) for r in paired],
                        "tollgate_over_baseline": round(ratio, 3) if ratio else None,
                        "target": f"<= {AB_MAX_RATIO}",
                        "met": bool(ratio <= AB_MAX_RATIO) if ratio else None,
                    }
        if "budgets" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    # Edge and fold worker together (budgets are decided on the edge and trued
                    # up by the bills).
                    paired = paired_ratios(raw_runs, "budgets", "tollgate", mode, c)
                    ratio = med(paired) if paired else None
                    verdicts[f"budgets_cpu_{mode}_c{c}"] = {
                        "budgets_ms": closed["budgets"][mode][str(c)]["cpu_ms_per_req"],
                        "plain_ms": closed["tollgate"][mode][str(c)]["cpu_ms_per_req"],
                        "budgets_over_plain_per_run": [round(r, 3) for r in paired],
                        "budgets_over_plain": round(ratio, 3) if ratio else None,
                        "target": f"<= {BUDGETS_MAX_RATIO}",
                        "met": bool(ratio <= BUDGETS_MAX_RATIO) if ratio else None,
                    }
        if "distributed" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    # The edge process alone in both modes.
                    paired = paired_ratios(
                        raw_runs, "distributed", "tollgate", mode, c, "edge_cpu_ms_per_req"
                    )
                    dist = closed["distributed"][mode][str(c)]
                    emb = closed["tollgate"][mode][str(c)]
                    ratio = med(paired) if paired else None
                    verdicts[f"distributed_cpu_{mode}_c{c}"] = {
                        "distributed_edge_ms": dist["edge_cpu_ms_per_req"],
                        "embedded_edge_ms": emb["edge_cpu_ms_per_req"],
                        "distributed_over_embedded_per_run": [round(r, 3) for r in paired],
                        "distributed_over_embedded": ratio,
                        "distributed_pipeline_ms": dist["pipeline_cpu_ms_per_req"],
                        "embedded_total_ms": emb["cpu_ms_per_req"],
                        "target": "(comparison)",
                        "met": None,
                    }
        if "traced" in closed and "tollgate" in closed:
            verdicts.update(tracing_verdicts(raw_runs, closed, modes, conns))
            # Every span of the traced target's requests, flushed by its stop, over its requests.
            tr.stop()
            result["tracing_sink"] = sink_counts(sink_url, work / "data-traced")
        for mode, per_rate in open_res.items():
            for rate_s, o in per_rate.items():
                a = o["added_p99_ms"]
                ok = o["tollgate_ok_fraction"] >= 0.999
                verdicts[f"p99_added_{mode}_{rate_s}"] = {
                    "mode": mode,
                    "offered_rps": o["offered_rps"],
                    "added_ms": a,
                    "tollgate_ok_fraction": o["tollgate_ok_fraction"],
                    "target": f"<= {TARGET_P99_ADDED_MS}",
                    # failed requests are not in the p99: a rate Tollgate drops is a miss
                    "met": bool(ok and a == a and a <= TARGET_P99_ADDED_MS),
                }
        result["verdicts"] = verdicts

        if args.profile:
            spy = shutil.which("py-spy") or str(venv / "bin" / "py-spy")
            if tg.p.poll() is not None:
                tg, tg_url, tg_key = start_tollgate(up_url, work / "data-profile", work)
                procs.append(tg)
            result["profile"] = {}
            for mode in modes:
                try:
                    result["profile"][mode] = profile_tollgate(
                        tg.pid,
                        tg_url,
                        tg_key,
                        mode == "stream",
                        max(8.0, args.duration),
                        spy,
                        RESULTS.parent,
                    )
                except Exception as exc:  # recorded, the figures above still get written
                    result["profile"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    except BaseException as exc:
        result["aborted"] = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        stack.close()
        result["logs"] = str(work)
        result["tollgate_deaths"] = deaths
        write_result(args.output, result)
    print(json.dumps(result.get("verdicts", {}), indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
