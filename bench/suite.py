"""The benchmark suite as one table: each script's name, module, options (full and quick) and the
renderer of its result JSON (bench/results/<name>.json); `run` runs the chosen ones, each in its
own process, and `assemble` writes BENCHMARKS.md from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import quality_startup, router_evaluation
from bench import render as r
from bench.common import RESULTS_DIR, ROOT, machine

OUT = ROOT / "BENCHMARKS.md"


@dataclass(frozen=True)
class Bench:
    name: str  # also its result's name: bench/results/<name>.json and <name>.log
    module: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    render: Callable[[Any], list[str]] = r.render_generic

    @property
    def json_name(self) -> str:
        return f"{self.name}.json"


# The last commit before the architecture rework (issue 11), served beside this checkout.
ARCHITECTURE_AB = (
    "--baseline-commit", "4279919", "--no-litellm", "--no-open-loop", "--connections", "16",
    "--output", "bench/results/architecture_ab.json",
)  # fmt: skip

# Architecture step two (issue 28: admission as one service over steps, real ports, api/ split,
# domain/ by stream, one installed package) and the capabilities added beside it, against the
# commit before its first change: the same gateway path's CPU per request, paired within each run.
STEP_TWO_AB = (
    "--baseline-commit", "0594574", "--no-litellm", "--no-open-loop", "--connections", "16",
    "--output", "bench/results/step_two_ab.json",
)  # fmt: skip

# Issue 15: a key on a four-level path with limits and budgets at every level, beside a key of
# the organization, in one run.
BUDGETS_AB = (
    "--budgets", "--closed-targets", "tollgate,budgets", "--no-litellm", "--no-open-loop",
    "--connections", "16", "--output", "bench/results/budgets_ab.json",
)  # fmt: skip

# Tracing on (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` at a local sink that discards) against off,
# through the real HTTP server, paired per run.
TRACING_AB = (
    "--tracing", "--closed-targets", "tollgate,traced", "--no-litellm", "--no-open-loop",
    "--connections", "16", "--output", "bench/results/tracing_http.json",
)  # fmt: skip

DISTRIBUTED_AB = (
    "--distributed", "--closed-targets", "tollgate,distributed", "--no-litellm", "--no-open-loop",
    "--connections", "16", "--output", "bench/results/distributed_ab.json",
)  # fmt: skip

# In BENCHMARKS.md's order.
BENCHES: tuple[Bench, ...] = (
    Bench(
        "store_append", "bench.store_append",
        quick_args=("--events", "3000", "--single-events", "300", "--runs", "1"),
        render=r.render_store,
    ),
    Bench("fold_throughput", "bench.fold_throughput", render=r.render_fold),
    Bench("admission_latency", "bench.admission_latency", render=r.render_admission),
    Bench("path_admission", "bench.path_admission", render=r.render_path_admission),
    Bench("upstream_client", "bench.upstream_client", quick_args=("--requests", "100")),
    Bench("upstream_metrics", "bench.upstream_metrics"),
    Bench("finance_scale", "bench.finance_scale", quick_args=("--quick",)),
    Bench(
        "gateway", "bench.gateway", ("--runs", "3", "--profile"), ("--quick",),
        render=r.render_gateway,
    ),
    Bench(
        "estimator", "bench.estimator", quick_args=("--repeat", "50"),
        render=r.render_estimator,
    ),
    Bench(
        "vllm_overhead", "bench.vllm_overhead", quick_args=("--rounds", "1", "--requests", "32"),
        render=r.render_vllm_overhead,
    ),
    Bench("fleet_ops", "bench.fleet_ops", quick_args=("--quick",), render=r.render_fleet_ops),
    Bench(
        "pipeline", "bench.pipeline",
        quick_args=("--requests", "2000", "--runs", "1", "--duration", "10",
                    "--sustained-runs", "1"),
        render=r.render_pipeline,
    ),
    # The architecture rework (edge over ports, one command handler) against the commit before
    # it: CPU per request of the same gateway path, paired within each run. Nine runs: single
    # paired runs spread from 0.98 to 1.20 on this machine, a 5 % target.
    Bench(
        "architecture_ab", "bench.gateway", (*ARCHITECTURE_AB, "--runs", "9"),
        (*ARCHITECTURE_AB, "--quick"), render=r.render_gateway,
    ),
    Bench(
        "step_two_ab", "bench.gateway", (*STEP_TWO_AB, "--runs", "5"), (*STEP_TWO_AB, "--quick"),
        render=r.render_gateway,
    ),
    Bench(
        "budgets_ab", "bench.gateway", (*BUDGETS_AB, "--runs", "5"), (*BUDGETS_AB, "--quick"),
        render=r.render_gateway,
    ),
    # The same A/B counted in instructions (valgrind): edge event loop and fold passes.
    Bench(
        "instructions", "bench.instructions", quick_args=("--requests", "200"),
        render=r.render_instructions,
    ),
    Bench(
        "output_prediction", "bench.output_prediction", quick_args=("--quick",),
        render=r.render_output_prediction,
    ),
    Bench(
        "router_evaluation", "bench.router_evaluation", quick_args=("--quick",),
        render=router_evaluation.render,
    ),
    Bench(
        "quality_startup", "bench.quality_startup", quick_args=("--quick",),
        render=quality_startup.render,
    ),
    Bench(
        "edges", "bench.edges", quick_args=("--runs", "1", "--duration", "5"),
        render=r.render_edges,
    ),
    # The edge's CPU per request in the distributed mode (`tollgate api` + relay + a Kafka
    # worker on PostgreSQL) against the embedded one (`tollgate serve`), paired per run.
    Bench(
        "distributed_ab", "bench.gateway", (*DISTRIBUTED_AB, "--runs", "5"),
        (*DISTRIBUTED_AB, "--quick"), render=r.render_gateway,
    ),
    # Issue 31: direct, nginx, the aiohttp floor, Tollgate embedded and distributed (and
    # LiteLLM) behind one mock that answers at once, at 1, 16 and 64 connections.
    Bench(
        "overhead", "bench.overhead", ("--runs", "3"), ("--quick",), render=r.render_overhead,
    ),
    # The CPU the OpenTelemetry spans of a request cost on the edge's path
    # (api/services/tracing.py).
    Bench(
        "tracing", "bench.tracing", quick_args=("--requests", "300", "--rounds", "2"),
        render=r.render_tracing,
    ),
    # The same through the real HTTP server (`tollgate serve` under wrk, the spans POSTed to a
    # local OTLP sink), beside the same server untraced, in one run.
    Bench(
        "tracing_http", "bench.gateway", (*TRACING_AB, "--runs", "3", "--duration", "6"),
        (*TRACING_AB, "--quick"), render=r.render_gateway,
    ),
)  # fmt: skip
NAMES = tuple(b.name for b in BENCHES)


def run(names: list[str], quick: bool) -> dict[str, dict[str, Any]]:
    """Run the named scripts, each in its own process with its output in bench/results/<name>.log;
    what each exited with, how long it took and when it started (a JSON older is stale)."""
    status: dict[str, dict[str, Any]] = {}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for bench in BENCHES:
        if bench.name not in names:
            continue
        cmd = [sys.executable, "-m", bench.module, *(bench.quick_args if quick else bench.args)]
        print(f"== {bench.name}: {' '.join(cmd[1:])}", flush=True)
        started = time.time()
        log = RESULTS_DIR / f"{bench.name}.log"
        with log.open("wb") as f:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        took = time.time() - started
        status[bench.name] = {
            "rc": rc,
            "seconds": round(took),
            "started": started,
            "command": " ".join(["python", *cmd[1:]]),
        }
        print(f"   exit {rc} after {took:.0f} s (log: {log.relative_to(ROOT)})", flush=True)
    return status


def assemble(status: dict[str, dict[str, Any]], quick: bool, argv: list[str]) -> str:
    m = {**machine(), "date": datetime.now(UTC).isoformat(timespec="seconds")}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `./dev bench` (`python -m bench`); do not edit by hand.",
        "",
        f"- assembled on: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux "
        f"{m['kernel']}; a section measured elsewhere names its own machine where it recorded one",
        f"- Python {m['python']}; assembled {m['date']}",
        f"- command: `python -m bench {' '.join(argv)}`"
        + (" (quick: smaller runs)" if quick else ""),
        "- the machine is shared and noisy: each figure is the median of several runs, and "
        "comparisons are ratios measured within one run.",
        "",
    ]
    for bench in BENCHES:
        lines += _section(bench, status.get(bench.name))
    return "\n".join(lines) + "\n"


def _section(bench: Bench, st: dict[str, Any] | None) -> list[str]:
    name, json_name = bench.name, bench.json_name
    lines = [f"## {name}", ""]
    path = RESULTS_DIR / json_name
    if st:
        lines.append(f"Command: `{st['command']}` — exit {st['rc']}, {st['seconds']} s.")
    else:
        lines.append(f"Not run by this invocation (`python -m {bench.module}`).")
    data = None
    if path.exists():
        fresh = st is None or path.stat().st_mtime >= st["started"]
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            lines.append(f"\n**{json_name} is not valid JSON**: {exc}")
        if data is not None and not fresh:
            lines.append(
                f"\n**The script did not rewrite {json_name} in this run**; the figures "
                "below are from an earlier run "
                f"({datetime.fromtimestamp(path.stat().st_mtime, UTC):%Y-%m-%d %H:%M} UTC)."
            )
    if st and st["rc"] != 0:
        lines.append(f"\n**FAILED** (exit {st['rc']}); last lines of bench/results/{name}.log:\n")
        lines += ["```", *_tail(RESULTS_DIR / f"{name}.log", 15), "```"]
    lines.append("")
    if data is not None:
        when = data.get("measured_at") if isinstance(data, dict) else None
        where = data.get("machine") if isinstance(data, dict) else None
        if isinstance(where, dict) and where.get("cpu"):
            cpus = f"{where.get('nproc', '?')} CPUs ({where['cpu']})"
            when = f"{when or 'at an unrecorded time'} on {cpus}"
        if when:
            lines += [f"Measured at {when}.", ""]
        lines += bench.render(data)
    elif st or (RESULTS_DIR / f"{name}.log").exists():
        lines += [
            f"No `{json_name}` was written; the script's output:",
            "",
            "```",
            *_tail(RESULTS_DIR / f"{name}.log", 25),
            "```",
        ]
    lines.append("")
    return lines


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ["(no log)"]
