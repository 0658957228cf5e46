"""`./dev bench` = `python -m bench`: run every benchmark script (each in its own process) and
assemble BENCHMARKS.md from bench/results/*.json.

    python -m bench [--quick] [--only a,b] [--skip a,b] [--no-run]

--quick passes each script its small-run options; --no-run only re-assembles BENCHMARKS.md from
the JSON already in bench/results/. Every script's output goes to bench/results/<name>.log.
A script that fails, or does not (re)write its JSON, is reported as such in BENCHMARKS.md: a
figure is never carried over silently from an older run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "BENCHMARKS.md"


# name, module, normal args, quick args, result JSON (None: the script prints only)
BENCHES: list[tuple[str, str, list[str], list[str], str | None]] = [
    (
        "store_append",
        "bench.store_append",
        [],
        ["--events", "3000", "--single-events", "300", "--runs", "1"],
        "store_append.json",
    ),
    ("fold_throughput", "bench.fold_throughput", [], [], "fold_throughput.json"),
    ("admission_latency", "bench.admission_latency", [], [], "admission_latency.json"),
    ("upstream_client", "bench.upstream_client", [], ["--requests", "100"], "upstream_client.json"),
    ("upstream_metrics", "bench.upstream_metrics", [], [], "upstream_metrics.json"),
    ("finance_scale", "bench.finance_scale", [], ["--quick"], "finance_scale.json"),
    ("gateway", "bench.gateway", ["--runs", "3", "--profile"], ["--quick"], "gateway.json"),
]


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_gib = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem_gib = 0.0
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def run_all(names: list[str], quick: bool) -> dict[str, dict[str, Any]]:
    status: dict[str, dict[str, Any]] = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name, module, args, quick_args, _ in BENCHES:
        if name not in names:
            continue
        cmd = [sys.executable, "-m", module, *(quick_args if quick else args)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.time()
        log = RESULTS / f"{name}.log"
        with log.open("wb") as f:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        took = time.time() - started
        status[name] = {
            "rc": rc,
            "seconds": round(took),
            "started": started,
            "command": " ".join(["python", *cmd[1:]]),
        }
        print(f"   exit {rc} after {took:.0f} s (log: {log.relative_to(ROOT)})", flush=True)
    return status


# --- rendering -----------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:,.{digits}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "**MISSED**")


def render_admission(d: dict[str, Any]) -> list[str]:
    t = d.get("target_p99_us")
    p99 = d.get("p99_us_median")
    return [
        "| figure (median of runs) | value | target | verdict |",
        "| --- | --- | --- | --- |",
        f"| admission decision p50 | {_fmt(d.get('p50_us_median'))} µs | | |",
        f"| admission decision p99 | {_fmt(p99)} µs | ≤ {t} µs | "
        f"{_verdict(p99 <= t if p99 is not None and t is not None else None)} |",
        f"| admission decision p99.9 | {_fmt(d.get('p999_us_median'))} µs | | |",
        "",
        f"{d.get('runs')} runs of {_fmt(d.get('decisions_per_run'))} decisions; "
        f"p99 per run: {d.get('p99_us_runs')}",
    ]


def render_fold(d: dict[str, Any]) -> list[str]:
    t = d.get("target_events_per_s")
    rows = ["| fold (median of runs) | events/s | target | verdict |", "| --- | --- | --- | --- |"]
    for key, label in (
        ("lifecycle_fold_events_per_s_median", "request lifecycle evolve"),
        ("quota_view_apply_events_per_s_median", "QuotaView.apply"),
    ):
        v = d.get(key)
        if v is not None:
            rows.append(
                f"| {label} | {_fmt(v)} | ≥ {_fmt(t)} | "
                f"{_verdict(v >= t if t is not None else None)} |"
            )
    rows += [
        "",
        f"{d.get('runs')} runs over {_fmt(d.get('streams'))} streams "
        f"({_fmt(d.get('events'))} events).",
    ]
    return rows


def render_store(d: dict[str, Any]) -> list[str]:
    rows = ["| backend | case | events/s (median) | runs |", "| --- | --- | --- | --- |"]
    for backend, cases in (d.get("results") or {}).items():
        for case, fig in cases.items():
            rows.append(
                f"| {backend} | {case} | {_fmt(fig.get('events_per_s_median'))} | "
                f"{fig.get('runs')} |"
            )
    t = d.get("target") or d.get("targets")
    rows += ["", f"Target: {t}" if t else "No target is recorded in the JSON for this script."]
    return rows


def render_gateway(d: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    up = d.get("upstream", {})
    rows.append(
        f"Upstream: `{up.get('kind')}` ({up.get('output_tokens')} chunks per answer, "
        f"{up.get('gap_ms')} ms between chunks); LiteLLM {d.get('litellm_version', 'not run')}; "
        f"{d.get('runs')} runs × {d.get('duration_s')} s per cell, interleaved; medians."
    )
    rows.append("")
    closed = d.get("closed_loop", {})
    rows += [
        "CPU/request = server CPU during the measured window ÷ requests finished in it. A "
        "saturated server (LiteLLM at 64 connections, p50 in seconds) also spends CPU on requests "
        "still in flight at the end, so its figure there is inflated; the 16-connection cells "
        "are the fair comparison.",
        "",
        "### Closed loop (wrk)",
        "",
        "| target | mode | conns | req/s | p50 ms | p99 ms | server CPU ms/req | "
        "upstream CPU ms/req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target, modes in closed.items():
        for mode, per_c in modes.items():
            for c, s in per_c.items():
                rows.append(
                    f"| {target} | {mode} | {c} | {_fmt(s['rps'], 1)} | {_fmt(s['p50_ms'])} "
                    f"| {_fmt(s['p99_ms'])} | {_fmt(s['cpu_ms_per_req'], 3)} | "
                    f"{_fmt(s['upstream_cpu_ms_per_req'], 3)} | {s['errors_total']} |"
                )
    rows.append("")
    tg = closed.get("tollgate", {})
    if any("server_thread_cpu_ms_per_req" in s for per_c in tg.values() for s in per_c.values()):
        rows += [
            "Where Tollgate's CPU per request goes: the edge process by thread (/proc/PID/task; "
            "`event_loop` is the main thread, `other_threads` the group-commit writer and the "
            "control-plane follower), and its child processes (the fold worker: billing, read "
            "models, leases) as the rest of the total:",
            "",
            "| mode | conns | per thread | child processes |",
            "| --- | --- | --- | --- |",
        ]
        for mode, per_c in tg.items():
            for c, s in per_c.items():
                th = s.get("server_thread_cpu_ms_per_req", {})
                children = s["cpu_ms_per_req"] - sum(th.values())
                rows.append(
                    f"| {mode} | {c} | "
                    + ", ".join(
                        f"{k} {v:.3f}" for k, v in sorted(th.items(), key=lambda kv: -kv[1])
                    )
                    + f" | {children:.3f} |"
                )
        rows.append("")
    rows += [
        "### Targets",
        "",
        "| figure | Tollgate | reference | target | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, v in (d.get("verdicts") or {}).items():
        if key.startswith("cpu_ratio"):
            rows.append(
                f"| CPU/request, {key.removeprefix('cpu_ratio_')} | {_fmt(v['tollgate_ms'], 3)} ms "
                f"| LiteLLM {_fmt(v['litellm_ms'], 3)} ms (ratio {v['litellm_over_tollgate']}×) "
                f"| LiteLLM/Tollgate ≥ 10× | {_verdict(v['met'])} |"
            )
        else:
            rows.append(
                f"| p99 added at {_fmt(v.get('offered_rps'), 0)} req/s open loop, {v.get('mode')}"
                f" (Tollgate answered {_fmt(100 * v.get('tollgate_ok_fraction', 0), 1)} %) | "
                f"{_fmt(v['added_ms'])} ms | | ≤ 5 ms | {_verdict(v['met'])} |"
            )
    ref = d.get("issue_reference_ms", {})
    if ref:
        rows += [
            "",
            "Reference CPU per request from the issue (same machine class): "
            + "; ".join(
                f"{k}: {v['json']} ms JSON / {v['stream']} ms per 16-chunk stream"
                for k, v in ref.items()
            ),
        ]
    ol = d.get("open_loop", {})
    if ol:
        rows += [
            "",
            "### Open loop (scheduled sends, latency from the scheduled time)",
            "",
            "| mode | offered req/s | direct p50 / p99 ms | Tollgate p50 / p99 ms "
            "| added p50 / p99 ms | added p99 per run | Tollgate CPU ms/req | non-200 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, per_rate in ol.items():
            for o in per_rate.values():
                rows.append(
                    f"| {mode} | {_fmt(o['offered_rps'], 0)} | {_fmt(o['direct_p50_ms'])} / "
                    f"{_fmt(o['direct_p99_ms'])} | {_fmt(o['tollgate_p50_ms'])} / "
                    f"{_fmt(o['tollgate_p99_ms'])} | {_fmt(o['added_p50_ms'])} / "
                    f"{_fmt(o['added_p99_ms'])} | {o['added_p99_ms_runs']} | "
                    f"{_fmt(o.get('tollgate_cpu_ms_per_req'), 3)} | {o['non_200']} |"
                )
    deaths = d.get("tollgate_deaths")
    if deaths:
        rows += [
            "",
            f"**Tollgate exited during the run {len(deaths)} time(s)** and was restarted "
            "on a fresh data dir: "
            + "; ".join(f"before {x['after']} (exit {x['returncode']})" for x in deaths),
        ]
    if d.get("aborted"):
        rows += ["", f"**The run was aborted**: {d['aborted']}"]
    prof = d.get("profile")
    if prof:
        rows += ["", "### Where Tollgate's CPU goes (py-spy, 16 connections)", ""]
        for mode, by_process in prof.items():
            if "samples" in by_process or "error" in by_process:  # results of older runs
                by_process = {"edge": by_process}
            for process, p in by_process.items():
                rows += _profile_rows(f"{mode}, {process}", p)
    return rows


def _profile_rows(title: str, p: dict[str, Any]) -> list[str]:
    if "error" in p:
        return [f"- {title}: py-spy failed: {p['error']}"]
    rows = [
        f"{title}: {p['samples']} samples; share of samples per thread: "
        + ", ".join(f"{t} {v}%" for t, v in p.get("threads_pct", []))
        + ".",
        "",
        "| Tollgate function (inclusive) | % of samples |",
        "| --- | --- |",
    ]
    own = ("(api/", "(ledger/", "(streams/", "(domain/", "(engine_adapter/")
    skip = ("serve (api/cli", "one_line_errors", "run (api/serve", "run_worker", "worker (api/cli")
    for f, pct in p.get("top_inclusive_pct", []):
        if f.startswith(skip) or not any(o in f for o in own):
            continue
        rows.append(f"| `{f}` | {pct} |")
    rows += ["", "| function (self) | % of samples |", "| --- | --- |"]
    for f, pct in p.get("top_self_pct", [])[:12]:
        rows.append(f"| `{f}` | {pct} |")
    rows.append("")
    return rows


def render_generic(d: Any) -> list[str]:
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, int | float) and not isinstance(x, bool):
            flat.append((prefix, x))

    walk("", d)
    keep = [
        (k, v)
        for k, v in flat
        if "median" in k or "target" in k or k.endswith("_ms") or k.endswith("_us") or "per_" in k
    ] or flat
    rows = ["| figure | value |", "| --- | --- |"]
    rows += [f"| {k} | {_fmt(v, 3)} |" for k, v in keep[:60]]
    rows += ["", "No target is recorded in this script's JSON; see its docstring."]
    return rows


RENDERERS = {
    "admission_latency": render_admission,
    "fold_throughput": render_fold,
    "store_append": render_store,
    "gateway": render_gateway,
}


def assemble(status: dict[str, dict[str, Any]], quick: bool, argv: list[str]) -> str:
    m = machine()
    lines = [
        "# Benchmarks",
        "",
        "Generated by `./dev bench` (`python -m bench`); do not edit by hand.",
        "",
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux {m['kernel']}",
        f"- Python {m['python']}; assembled {m['date']}",
        f"- command: `python -m bench {' '.join(argv)}`"
        + (" (quick: smaller runs)" if quick else ""),
        "- the machine is shared and noisy: each figure is the median of several runs, and "
        "comparisons are ratios measured within one run.",
        "",
    ]
    for name, module, _, _, json_name in BENCHES:
        lines.append(f"## {name}")
        lines.append("")
        st = status.get(name)
        path = RESULTS / json_name if json_name else None
        if st:
            lines.append(f"Command: `{st['command']}` — exit {st['rc']}, {st['seconds']} s.")
        else:
            lines.append(f"Not run by this invocation (`python -m {module}`).")
        data = None
        if path is not None and path.exists():
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
            lines.append(
                f"\n**FAILED** (exit {st['rc']}); last lines of bench/results/{name}.log:\n"
            )
            lines += ["```", *_tail(RESULTS / f"{name}.log", 15), "```"]
        lines.append("")
        if data is not None:
            when = data.get("measured_at") if isinstance(data, dict) else None
            if when:
                lines += [f"Measured at {when}.", ""]
            lines += RENDERERS.get(name, render_generic)(data)
        elif st or (RESULTS / f"{name}.log").exists():
            lines += [
                f"No `{json_name}` was written; the script's output:",
                "",
                "```",
                *_tail(RESULTS / f"{name}.log", 25),
                "```",
            ]
        lines.append("")
    return "\n".join(lines) + "\n"


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ["(no log)"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs of every script")
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names")
    ap.add_argument("--no-run", action="store_true", help="only assemble BENCHMARKS.md")
    args = ap.parse_args(argv)
    names = [b[0] for b in BENCHES]
    if args.only:
        names = [n for n in args.only.split(",") if n]
    names = [n for n in names if n not in set(args.skip.split(","))]
    unknown = set(names) - {b[0] for b in BENCHES}
    if unknown:
        sys.exit(
            f"unknown benchmark(s): {', '.join(sorted(unknown))}; "
            f"known: {', '.join(b[0] for b in BENCHES)}"
        )
    status = {} if args.no_run else run_all(names, args.quick)
    OUT.write_text(assemble(status, args.quick, argv))
    print(f"wrote {OUT.relative_to(ROOT)}")
    if any(s["rc"] != 0 for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
