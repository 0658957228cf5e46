"""BENCHMARKS.md's sections: one renderer per result JSON (bench/suite.py's table names which),
each turning a script's figures into Markdown rows, its targets beside them and a plain
**MISSED** when one is not met."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final


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


@dataclass(frozen=True)
class Figure:
    """One row of a figures table: its label, its key in the result JSON and, for a figure with
    a target, the key of its upper bound there."""

    label: str
    key: str
    bound_key: str | None = None


def _figure_rows(d: dict[str, Any], figures: tuple[Figure, ...], unit: str) -> list[str]:
    rows = []
    for f in figures:
        v = d.get(f.key)
        if f.bound_key is None:
            rows.append(f"| {f.label} | {_fmt(v)} {unit} | | |")
        else:
            t = d.get(f.bound_key)
            rows.append(f"| {f.label} | {_fmt(v)} {unit} | ≤ {t} {unit} | {_verdict(_le(v, t))} |")
    return rows


ADMISSION: Final = (
    Figure("admission decision p50", "p50_us_median"),
    Figure("admission decision p99", "p99_us_median", "target_p99_us"),
    Figure("admission decision p99.9", "p999_us_median"),
)


def render_admission(d: dict[str, Any]) -> list[str]:
    return [
        "| figure (median of runs) | value | target | verdict |",
        "| --- | --- | --- | --- |",
        *_figure_rows(d, ADMISSION, "µs"),
        "",
        f"{d.get('runs')} runs of {_fmt(d.get('decisions_per_run'))} decisions; "
        f"p99 per run: {d.get('p99_us_runs')}",
    ]


def _le(value: Any, target: Any) -> bool | None:
    return value <= target if value is not None and target is not None else None


def render_path_admission(d: dict[str, Any]) -> list[str]:
    t = d.get("target_p99_us")
    p99 = d.get("path_p99_us_median")
    return [
        "| figure (median of runs) | four-level path, budgets on | single level | target | "
        "verdict |",
        "| --- | --- | --- | --- | --- |",
        f"| admission decision p50 | {_fmt(d.get('path_p50_us_median'))} µs | "
        f"{_fmt(d.get('single_p50_us_median'))} µs | | |",
        f"| admission decision p99 | {_fmt(p99)} µs | {_fmt(d.get('single_p99_us_median'))} µs "
        f"| ≤ {t} µs | {_verdict(p99 <= t if p99 is not None and t is not None else None)} |",
        f"| admission decision p99.9 | {_fmt(d.get('path_p999_us_median'))} µs | "
        f"{_fmt(d.get('single_p999_us_median'))} µs | | |",
        f"| CPU time per decision p50 | {_fmt(d.get('path_cpu_p50_us_median'))} µs | "
        f"{_fmt(d.get('single_cpu_p50_us_median'))} µs | | |",
        f"| CPU time per decision p99 | {_fmt(d.get('path_cpu_p99_us_median'))} µs | "
        f"{_fmt(d.get('single_cpu_p99_us_median'))} µs | ≤ {t} µs | "
        f"{_verdict(_le(d.get('path_cpu_p99_us_median'), t))} |",
        f"| CPU time of a fixed loop as long as the path's p50, p50 / p99 (the machine's floor) "
        f"| {_fmt(d.get('reference_cpu_p50_us_median'))} / "
        f"{_fmt(d.get('reference_cpu_p99_us_median'))} µs | | | |",
        "",
        "The wall-clock rows include the time the process was preempted (a decision that "
        "straddles a preemption takes milliseconds); the CPU-time rows are this thread's CPU "
        "time per decision (`time.thread_time_ns`), what an idle core would take. The last row "
        "times a plain loop of additions the same way, sized in each run to the path "
        "decision's p50: nothing allocated, nothing collected, so its p99 is what the machine "
        "alone adds to work of that length (interrupts are billed to the thread, and other "
        "work cools its caches).",
        "",
        f"{d.get('runs')} runs of {_fmt(d.get('decisions_per_run'))} decisions; organization → "
        "workspace → project → key with a project rate limit, a budget at every level and one "
        f"call in ten in a run; the path policy is looked up per decision, as the edge does; "
        f"garbage collector: {d.get('gc', 'defaults')}. Path p99 per run: "
        f"{d.get('path_p99_us_runs')}; 1-minute load average before and after: "
        f"{d.get('load_avg_1m')} (the tail is the scheduler's as much as the decision's when "
        "the machine is shared).",
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


def render_pipeline(d: dict[str, Any]) -> list[str]:
    t = d.get("target_events_per_s")
    command = (d.get("command") or "").strip()
    rows = [f"Recorded with `{command}` (defaults: the figures below state them).", ""] if (
        command
    ) else []
    rows += ["| stage (median of runs) | events/s | runs | target | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for key, label in (
        ("relay_events_per_s", "outbox relay alone: store → topic (idempotent producer, acks=all)"),
        ("worker_events_per_s", "one Kafka worker alone: topic → bills + read models + offsets"),
    ):
        v = d.get(f"{key}_median")
        runs = ", ".join(_fmt(x) for x in d.get(f"{key}_runs") or [])
        rows.append(
            f"| {label} | {_fmt(v)} | {runs} | ≥ {_fmt(t)} | "
            f"{_verdict(v >= t if v is not None and t is not None else None)} |"
        )
    sus = d.get("sustained") or {}
    per_run = sus.get("per_run") or []
    if sus:
        v, lag99, tl = sus.get("events_per_s_median"), sus.get("lag_p99_s_median"), sus.get(
            "target_lag_p99_s"
        )
        rows += [
            f"| **whole pipeline at once**: store commit → ledger row ({sus.get('workers')} "
            f"workers + relay as processes) | {_fmt(v)} | "
            f"{', '.join(_fmt(round(r['events_per_s'])) for r in per_run)} | ≥ {_fmt(t)} | "
            f"{_verdict(v >= t if v is not None and t is not None else None)} |",
            "",
            "| billing lag, terminal event → ledger row (median of runs) | s | runs | target | "
            "verdict |",
            "| --- | --- | --- | --- | --- |",
            f"| p50 | {_fmt(sus.get('lag_p50_s_median'), 3)} | "
            f"{', '.join(_fmt(r['lag_p50_s'], 3) for r in per_run)} | | |",
            f"| p99 | {_fmt(lag99, 3)} | {', '.join(_fmt(r['lag_p99_s'], 3) for r in per_run)} "
            f"| ≤ {tl} | {_verdict(_le(lag99, tl))} |",
            "",
            "| run | offered events/s | requests | offering s | drain after s | lag max s | "
            "group commit ms p50 / p99 | "
            "CPU s of each part (the appender over the offered window; the others over offering "
            "and drain) | load 1 min before → after |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for i, r in enumerate(per_run, start=1):
            rows.append(
                f"| {i} | {_fmt(r['offered_events_per_s'])} | {_fmt(r['requests'])} | "
                f"{r['offered_s']} | {r['drain_s']} | {_fmt(r['lag_max_s'], 3)} | "
                f"{r.get('group_commit_ms_p50', '–')} / {r.get('group_commit_ms_p99', '–')} | "
                f"{', '.join(f'{k} {v}' for k, v in r['cpu_s'].items())} | "
                f"{r['load_1m_before']} → {r['load_1m_after']} |"
            )
    for other in d.get("sustained_other_loads") or []:
        runs_ = other.get("per_run") or []
        lag99, tl = other.get("lag_p99_s_median"), other.get("target_lag_p99_s")
        both = bool(_le(lag99, tl)) and (other.get("events_per_s_median") or 0) >= (t or 0)
        rows += [
            "",
            f"The same at {_fmt(round(other.get('offered_events_per_s') or 0))} lifecycle events/s "
            "offered "
            f"({other.get('runs')} runs of {_fmt(other.get('duration_s'), 0)} s):",
            "",
            "| figure (median of runs) | value | runs | target | verdict |",
            "| --- | --- | --- | --- | --- |",
            f"| offered events/s | | {', '.join(_fmt(r['offered_events_per_s']) for r in runs_)}"
            " | | |",
            f"| sustained events/s | {_fmt(other.get('events_per_s_median'))} | "
            f"{', '.join(_fmt(round(r['events_per_s'])) for r in runs_)} | | |",
            f"| drain after the last append, s | | {', '.join(str(r['drain_s']) for r in runs_)}"
            " | | |",
            f"| billing lag p50, s | {_fmt(other.get('lag_p50_s_median'), 3)} | "
            f"{', '.join(_fmt(r['lag_p50_s'], 3) for r in runs_)} | | |",
            f"| billing lag p99, s | {_fmt(lag99, 3)} | "
            f"{', '.join(_fmt(r['lag_p99_s'], 3) for r in runs_)} | ≤ {tl} | "
            f"{_verdict(_le(lag99, tl))} |",
            *(
                [f"| sustained ≥ {_fmt(t)} events/s with that lag | | | | {_verdict(both)} |"]
                if t is not None and (other.get("offered_events_per_s") or 0) >= t else []
            ),
            "| group commit ms p50 / p99 per run | | "
            + "; ".join(
                f"{r.get('group_commit_ms_p50', '–')} / {r.get('group_commit_ms_p99', '–')}"
                for r in runs_
            )
            + " | | |",
            "| CPU s per run: appender, relay, workers, PostgreSQL, broker | | "
            + "; ".join(", ".join(str(v) for v in r["cpu_s"].values()) for r in runs_)
            + " | | |",
        ]
    rows += [
        "",
        f"Stages apart: {d.get('runs')} runs, each a fresh PostgreSQL schema and topic (8 "
        f"partitions) holding {_fmt(d.get('requests'))} completed requests "
        f"({_fmt(d.get('events'))} events).",
    ]
    if sus:
        rows += [
            "",
            f"Whole pipeline: {sus.get('runs')} runs, each a fresh schema and topic; `tollgate "
            f"relay` and {sus.get('workers')} × `tollgate worker` as processes while the bench "
            f"appends completed requests ({sus.get('events_per_request', 5)} lifecycle events "
            "each, in group commits of what is "
            f"due every 20 ms) at {_fmt(round(sus.get('offered_events_per_s') or 0))} lifecycle "
            "events/s "
            f"for {_fmt(sus.get('duration_s'), 0)} s; each request's bill makes a second trip "
            "through relay and worker (one event more per request on the topic). Events/s = "
            "lifecycle events appended ÷ (first append → last ledger row); lag = the ledger row's "
            "`recorded_at` (database clock at the insert, just before the worker's commit; "
            "migration 0014) − the terminal event's `occurred_at`. Offered events/s below the "
            "stated rate means the appender itself could not commit that fast. A group commit "
            "is one `append_many` of what was due (the edges' appends): its wall time includes "
            "the wait for the store's append lock, which the workers' bills take in turn (the "
            "store keeps the lock: positions follow commit order, which the SQL tails rely on).",
            "",
            f"Machine load: `{d.get('uptime_before')}` before, `{d.get('uptime_after')}` after "
            "(2 cores).",
        ]
    note = d.get("bottleneck")
    if note:
        rows += ["", f"Bottleneck: {note}"]
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


def _paired_row(
    figure: str, ms: float, reference: str, ratio: float, per_run: list[float],
    verdict: dict[str, Any],
) -> str:  # fmt: skip
    """A Targets row of a paired A/B: the figure, its reference, the median of the per-run
    ratios and each run's."""
    runs = ", ".join(f"{r:.3f}" for r in per_run)
    return (
        f"| {figure} | {_fmt(ms, 3)} ms | {reference} (paired ratio {ratio}; per run {runs}) "
        f"| ≤ {verdict['target'].removeprefix('<= ')} | {_verdict(verdict['met'])} |"
    )


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
        if key.startswith("ab_cpu"):
            rows.append(_paired_row(
                f"CPU/request against the baseline, {key.removeprefix('ab_cpu_')}",
                v["tollgate_ms"], f"baseline {_fmt(v['baseline_ms'], 3)} ms",
                v["tollgate_over_baseline"], v["tollgate_over_baseline_per_run"], v,
            ))  # fmt: skip
        elif key.startswith("budgets_cpu"):
            rows.append(_paired_row(
                "CPU/request, four-level path with budgets ÷ an organization key, "
                + key.removeprefix("budgets_cpu_"),
                v["budgets_ms"], f"organization key {_fmt(v['plain_ms'], 3)} ms",
                v["budgets_over_plain"], v["budgets_over_plain_per_run"], v,
            ))  # fmt: skip
        elif key.startswith("distributed_cpu"):
            per_run = ", ".join(f"{r:.3f}" for r in v["distributed_over_embedded_per_run"])
            rows.append(
                f"| edge CPU/request, distributed ÷ embedded, "
                f"{key.removeprefix('distributed_cpu_')} | `tollgate api` "
                f"{_fmt(v['distributed_edge_ms'], 3)} ms (+ relay, worker, broker "
                f"{_fmt(v['distributed_pipeline_ms'], 3)} ms) | `tollgate serve` edge "
                f"{_fmt(v['embedded_edge_ms'], 3)} ms (with its fold worker "
                f"{_fmt(v['embedded_total_ms'], 3)} ms); paired ratio "
                f"{v['distributed_over_embedded']}, per run {per_run} | (comparison) | n/a |"
            )
        elif key.startswith("tracing_cpu"):
            per_run = ", ".join(f"{r:.3f}" for r in v["traced_over_plain_per_run"])
            rows.append(
                f"| CPU/request, tracing on ÷ off, {key.removeprefix('tracing_cpu_')} | traced "
                f"{_fmt(v['traced_ms'], 3)} ms (edge {_fmt(v['traced_edge_ms'], 3)} ms) | "
                f"untraced {_fmt(v['plain_ms'], 3)} ms (edge {_fmt(v['plain_edge_ms'], 3)} ms); "
                f"added {_fmt(v['added_ms'], 3)} ms, paired ratio {v['traced_over_plain']} "
                f"(edge {v['edge_traced_over_plain']}), per run {per_run} | (comparison) | n/a |"
            )
        elif key.startswith("cpu_ratio"):
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
    sink = d.get("tracing_sink")
    if sink:
        rows += [
            "",
            f"The traced server exported {sink['spans']:,} spans in {sink['posts']:,} OTLP/HTTP "
            f"posts ({sink['bytes']:,} bytes) for the {sink['requests_admitted']:,} requests it "
            f"admitted: {sink['spans_per_request']} spans per request, each export answered by "
            "a local sink that keeps nothing (its CPU not counted as the server's).",
        ]
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
    skip = (  # the CLI's frames: api/cli.py in results recorded before the cli/ package
        "serve (api/cli", "serve (cli/serve", "one_line_errors", "run (api/serve", "run_worker",
        "worker (api/cli", "worker (cli/pipeline",
    )
    for f, pct in p.get("top_inclusive_pct", []):
        if f.startswith(skip) or not any(o in f for o in own):
            continue
        rows.append(f"| `{f}` | {pct} |")
    rows += ["", "| function (self) | % of samples |", "| --- | --- |"]
    for f, pct in p.get("top_self_pct", [])[:12]:
        rows.append(f"| `{f}` | {pct} |")
    rows.append("")
    return rows


def render_fleet_ops(d: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    mix = d.get("goodput_mix")
    if mix:
        rows += [
            f"Goodput by tier under the `{mix['profile']}` load profile ({mix['rate']} req/s for "
            f"{_fmt(mix['seconds'], 0)} s, default simulated fleet, SLO TTFT ≤ 1 s, TPOT ≤ 50 ms):",
            "",
            "| tier | offered | served | attained | goodput | attainment | not attained | "
            "live counters = replay |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for tier, t in sorted(mix["tiers"].items()):
            rows.append(
                f"| {tier} | {t['offered']} | {t['served']} | {t['attained']} | "
                f"{_fmt(t['goodput_pct'], 1)} % | {_fmt(t['attainment_pct'], 1)} % | "
                f"{', '.join(f'{k} {v}' for k, v in t['outcomes'].items()) or '—'} | "
                f"{'yes' if t['live_equals_replay'] else '**no**'} |"
            )
        rows.append("")
    ramp = d.get("ramp")
    if ramp:
        lead, target = ramp.get("lead_s"), ramp.get("target_lead_s")
        rows += [
            "The autoscaling signal's lead under a ramp (2 simulated replicas of 32k KV tokens, "
            f"arrivals from 1 req/s growing by {ramp['slope_requests_per_s2']} req/s every "
            f"second, cold start {_fmt(ramp['cold_start_s'], 0)} s):",
            "",
            "| figure | value | target | verdict |",
            "| --- | --- | --- | --- |",
            f"| first ask for a third replica | {_fmt(ramp.get('first_ask_s'), 1)} s | | |",
            f"| a replica crosses 0.85 | {_fmt(ramp.get('crossing_085_s'), 1)} s | | |",
            f"| lead | {_fmt(lead, 1)} s | ≥ {_fmt(target, 0)} s | {_verdict(ramp.get('met'))} |",
        ]
    return rows


def render_tracing(d: dict[str, Any]) -> list[str]:
    off, on, out = d["off_us_median"], d["on_us_median"], d["sampled_out_us_median"]
    return [
        f"The edge's path (`Edge.chat` over the unit tests' fakes, a 16-token stream read to its "
        f"end), {d['rounds']} interleaved rounds × {d['requests_per_round']} requests each way; "
        "CPU of the process, the span export thread and the OTLP protobuf encoding included "
        f"(not the POST); {d['spans_per_request']} spans per traced request.",
        "",
        "| tracing | CPU µs/request (median) | per round |",
        "| --- | --- | --- |",
        f"| off (no endpoint) | {off:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in d['off_us_per_request'])} |",
        f"| on, sampled | {on:.0f} (+{on - off:.0f}, ×{d['on_over_off_median']}) | "
        f"{', '.join(f'{x:.0f}' for x in d['on_us_per_request'])} |",
        f"| on, sampled out | {out:.0f} (+{out - off:.0f}) | "
        f"{', '.join(f'{x:.0f}' for x in d['sampled_out_us_per_request'])} |",
        "",
        "(comparison) No target: the cost is the SDK's, per span; a sampler "
        "(`OTEL_TRACES_SAMPLER=parentbased_traceidratio`) bounds it.",
    ]


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


def render_vllm_overhead(d: dict[str, Any]) -> list[str]:
    rows = [
        f"Engine: {d.get('engine')}; {d.get('rounds')} rounds × {d.get('requests_per_round')} "
        f"streamed requests per path, {d.get('concurrency')} at a time, "
        f"{d.get('output_tokens')} output tokens each, the paths interleaved round by round; "
        f"load average {d.get('load_average_1m')} on the shared machine at the end.",
        "",
        "| path | TTFT p50 ms | TTFT p99 ms | output tokens/s | errors | CPU s: engine | "
        "gateway | client |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("direct", "direct_continuous_usage", "tollgate"):
        p = d.get(name)
        if p is None:
            continue
        cpu = p.get("cpu_s") or {}
        rows.append(
            f"| {name} | {_fmt(p.get('ttft_p50_ms'), 1)} | {_fmt(p.get('ttft_p99_ms'), 1)} | "
            f"{_fmt(p.get('tokens_per_s'), 1)} | {p.get('errors', 0)} | "
            f"{_fmt(cpu.get('engine'))} | {_fmt(cpu.get('gateway'))} | {_fmt(cpu.get('client'))} |"
        )
    rows += [
        "",
        f"Added by Tollgate: TTFT p50 {_fmt(d.get('added_ttft_p50_ms'), 1)} ms, p99 "
        f"{_fmt(d.get('added_ttft_p99_ms'), 1)} ms; tokens/s through Tollgate ÷ direct = "
        f"{_fmt(d.get('tokens_per_s_ratio'), 3)}. `direct_continuous_usage` is the direct path "
        "with what Tollgate always asks of the engine (usage on every chunk, so a cancelled "
        "stream still has an engine count): the engine's share of the difference. Engine, "
        "gateway and client share the machine's cores, so the CPU columns say where they went.",
    ]
    return rows


def render_estimator(d: dict[str, Any]) -> list[str]:
    rows = [
        f"Per admission, on the tiny test model's tokenizer and chat template ({d.get('chats')} "
        f"chats; {d.get('note')}):",
        "",
        "| estimator | µs per call (median over chats) |",
        "| --- | --- |",
        f"| real, uncached (template render + encode) | {_fmt(d.get('uncached_us_median'), 1)} "
        f"(max {_fmt(d.get('uncached_us_max'), 1)}) |",
        f"| real, from the content cache | {_fmt(d.get('cached_us_median'), 1)} |",
        f"| simulator's word splitter | {_fmt(d.get('splitter_us_median'), 1)} |",
        "",
        "The splitter's error against the real count on the same chats: "
        f"{_fmt(d.get('splitter_error_pct_min'), 1)} % to "
        f"{_fmt(d.get('splitter_error_pct_max'), 1)} %.",
        "",
        "| chat | real tokens | splitter | error % | uncached µs | cached µs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in d.get("rows") or ():
        rows.append(
            f"| {r['chat']} | {r['prompt_tokens']} | {r['splitter_tokens']} | "
            f"{r['splitter_error_pct']} | {r['uncached_us']} | {r['cached_us']} |"
        )
    return rows


def render_output_prediction(d: dict[str, Any]) -> list[str]:
    t = d.get("targets") or {}
    q = d.get("quantile") or 0.95
    rows = [
        f"Traffic: `{d.get('generator')}` seed {d.get('generation_seed')}, "
        f"{_fmt(d.get('requests_sent'))} requests at {d.get('rate_per_s')}/s through "
        f"`tollgate serve` with three simulated replicas at {d.get('sim_speed')}× speed "
        f"({_fmt(d.get('logged_requests'))} admitted and logged; the rest met a full fleet). "
        f"Model: p{round(q * 100):g}, training seeds {d.get('train_seeds')} "
        f"(fitting {d.get('training_seconds')} s), judged on the "
        f"{_fmt(d.get('held_out_requests'))} held-out requests replayed through admission at "
        f"real time (×{d.get('sim_speed')}). Medians over the seeds. A refusal is *false* when "
        "the oracle (reserving exactly what was produced) admitted it; over-admission is the "
        "deepest a tokens/min bucket charged actual use at admission went below zero, ÷ limit.",
        "",
        "Tokens/min binding: each tenant's limit = X × its own offered tokens/min, no KV cap:",
        "",
        "| X | policy | admitted | reserved/actual | coverage | tokens/min 429 (false) | "
        "KV·s 429 (false) | peak over-admission |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_x = d.get("by_tpm_per_offered") or {}
    for x, s in by_x.items():
        for policy in ("max_tokens", "predicted", "oracle"):
            p = s.get(policy) or {}
            cov = p.get("coverage")
            over = p.get("peak_over_admission")
            rows.append(
                f"| {x} | {policy} | {_fmt(p.get('admitted'), 0)} | "
                f"{_fmt(p.get('reserved_per_actual'))} | "
                f"{'–' if cov is None else _fmt(cov, 3)} | {_fmt(p.get('refused_tokens'), 0)} "
                f"({_fmt(p.get('false_refused_tokens'), 0)}) | {_fmt(p.get('refused_kv'), 0)} "
                f"({_fmt(p.get('false_refused_kv'), 0)}) | "
                f"{'–' if over is None else _fmt(over * 100, 1) + ' %'} |"
            )
    kv = d.get("kv_cap") or {}
    rows += [
        "",
        f"KV·s binding: a {d.get('kv_gib_seconds')} GiB·s concurrent KV cap per tenant (the "
        "free plan's), no tokens/min limit:",
        "",
        "| policy | admitted | reserved/actual | KV·s 429 (false) |",
        "| --- | --- | --- | --- |",
    ]
    for policy in ("max_tokens", "predicted", "oracle"):
        p = kv.get(policy) or {}
        rows.append(
            f"| {policy} | {_fmt(p.get('admitted'), 0)} | {_fmt(p.get('reserved_per_actual'))} "
            f"| {_fmt(p.get('refused_kv'), 0)} ({_fmt(p.get('false_refused_kv'), 0)}) |"
        )
    rows += ["", "| target | figure | verdict |", "| --- | --- | --- |"]
    rows += _prediction_targets(by_x, q, t)
    inf = d.get("inference") or {}
    p99 = inf.get("p99_us_median")
    rows += [
        f"| inference p99 ≤ {t.get('inference_p99_us_max')} µs | {_fmt(p99)} µs (p50 "
        f"{_fmt(inf.get('p50_us_median'))}; {inf.get('runs')} runs × "
        f"{_fmt(inf.get('calls_per_run'))} calls, p99 per run {inf.get('p99_us_runs')}) | "
        f"{_verdict(None if p99 is None else p99 <= t['inference_p99_us_max'])} |",
        "",
        "reserved/actual per tenant (predicted policy):",
        "",
    ]
    for x, s in by_x.items():
        model = s.get("predicted") or {}
        per = model.get("by_tenant") or {}
        fallbacks = model.get("fallbacks") or {}
        rows.append(
            f"- X={x}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in per.items())
            + (f"; reserved the cap instead (first seed): {fallbacks}" if fallbacks else "")
        )
    ceiling = (d.get("ceiling") or {}).get("generator_latent") or {}
    if ceiling:
        rows += [
            "",
            f"The bound this traffic sets at p{round(q * 100):g}: a predictor that knew the "
            "generator's own distribution for every shape (the assistant of a chat, the size of "
            f"a document; nothing tells an agent's final answer from a tool call) reserves "
            f"{_fmt((ceiling.get('observable') or {}).get('overall'))}× what is produced "
            f"({(ceiling.get('observable') or {}).get('by_kind')}; "
            f"{_fmt(ceiling.get('draws'))} draws); only the length the prompt's text asks for "
            f"would take it to {_fmt(ceiling.get('asked_length'))}×, and no feature carries the "
            "prompt's text.",
        ]
    for other in d.get("other_quantiles") or []:
        oq = other.get("quantile") or 0.0
        bound = (other.get("generator_ceiling") or {}).get("overall")
        rows += [
            "",
            f"Trained at p{round(oq * 100):g} (`tollgate predictor train --quantile {oq}`), the "
            f"same slice and seeds; the generator's bound at p{round(oq * 100):g} is "
            f"{_fmt(bound)}×:",
            "",
            "| X | admitted (predicted) | reserved/actual | coverage | tokens/min 429 (false) | "
            "peak over-admission |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        other_x = other.get("by_tpm_per_offered") or {}
        for x, s in other_x.items():
            p = s.get("predicted") or {}
            cov, over = p.get("coverage"), p.get("peak_over_admission")
            rows.append(
                f"| {x} | {_fmt(p.get('admitted'), 0)} | {_fmt(p.get('reserved_per_actual'))} | "
                f"{'–' if cov is None else _fmt(cov, 3)} | {_fmt(p.get('refused_tokens'), 0)} "
                f"({_fmt(p.get('false_refused_tokens'), 0)}) | "
                f"{'–' if over is None else _fmt(over * 100, 1) + ' %'} |"
            )
        rows += ["", "| target | figure | verdict |", "| --- | --- | --- |"]
        rows += _prediction_targets(other_x, oq, t)
    return rows


def _prediction_targets(
    by_x: dict[str, Any], q: float, t: dict[str, Any]
) -> list[str]:
    """The issue's four targets for each tokens/min setting, judged for a model of quantile q."""
    rows = []
    for x, s in by_x.items():
        cap, model = s.get("max_tokens") or {}, s.get("predicted") or {}
        ratio, cap_ratio = model.get("reserved_per_actual"), cap.get("reserved_per_actual")
        cov, red = model.get("coverage"), s.get("false_token_429_reduction")
        over = max(model.get("peak_over_admission") or 0, cap.get("peak_over_admission") or 0)
        points = None if cov is None else abs(cov - q) * 100
        rows += [
            f"| X={x}: reserved/actual ≤ {t.get('reserved_per_actual_max')} (max_tokens ≥ "
            f"{t.get('reserved_per_actual_with_max_tokens_min')}) | {_fmt(ratio)} "
            f"({_fmt(cap_ratio)}) | "
            f"{_verdict(None if ratio is None else ratio <= t['reserved_per_actual_max'])} |",
            f"| X={x}: coverage within {t.get('coverage_within_points')} points of {q} | "
            f"{'–' if cov is None else _fmt(cov, 3)} | "
            f"{_verdict(None if points is None else points <= t['coverage_within_points'])} |",
            f"| X={x}: false tokens/min 429s reduced ≥ {t.get('false_token_429_reduction_min')}× "
            f"| {_fmt(red)}× | "
            f"{_verdict(None if red is None else red >= t['false_token_429_reduction_min'])} |",
            f"| X={x}: peak over-admission ≤ {_fmt(t.get('peak_over_admission_max', 0) * 100, 0)}"
            f" % | {_fmt(over * 100, 1)} % | "
            f"{_verdict(over <= t.get('peak_over_admission_max', 0))} |",
        ]
    return rows


def render_instructions(d: dict[str, Any]) -> list[str]:
    base = f"baseline {d.get('baseline_commit')}"
    edges = {(r["tree"], r["mode"]): r for r in d.get("edge", [])}
    workers = {r["tree"]: r for r in d.get("worker", [])}

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a and b else ""

    lines = [
        f"| instructions per request | Tollgate | {base} | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for mode in ("json", "stream"):
        t, b = edges.get(("tollgate", mode)), edges.get(("baseline", mode))
        if t and b:
            tv, bv = t["event_loop_per_request"], b["event_loop_per_request"]
            lines.append(
                f"| edge event loop, {mode} | {_fmt(tv)} | {_fmt(bv)} | {ratio(tv, bv)} |"
            )
    tw, bw = workers.get("tollgate"), workers.get("baseline")
    if tw and bw:
        lines.append(
            f"| fold worker passes | {_fmt(tw['per_request'])} | {_fmt(bw['per_request'])} | "
            f"{ratio(tw['per_request'], bw['per_request'])} |"
        )
        for mode in ("json", "stream"):
            t, b = edges.get(("tollgate", mode)), edges.get(("baseline", mode))
            if t and b:
                tv = t["event_loop_per_request"] + tw["per_request"]
                bv = b["event_loop_per_request"] + bw["per_request"]
                lines.append(
                    f"| **edge event loop + fold passes, {mode}** | {_fmt(tv)} | {_fmt(bv)} | "
                    f"**{ratio(tv, bv)}** |"
                )
                tv += t["other_threads_per_request"]
                bv += b["other_threads_per_request"]
                lines.append(
                    f"| edge, all its threads + fold passes, {mode} | {_fmt(tv)} | {_fmt(bv)} | "
                    f"{ratio(tv, bv)} |"
                )
    lines += [
        "",
        "Counted by valgrind's callgrind (`python -m bench.instructions`): an instruction "
        "count moves by well under 1 % between runs where CPU time on this machine moves by "
        "±10 %, but it leaves out the kernel, cache misses and mispredicted branches, so it "
        "stands beside the wall-clock A/B (architecture_ab), not in its place. Edge: the event "
        "loop thread of `tollgate serve` (the cheap upstream, 16 concurrent, after 200 warm-up "
        "requests), per answered request. Its other threads are shown apart and in the "
        "all-threads row: the control-plane follower polls on a timer, and under valgrind a "
        "second lasts ~50 times longer, so its share is overstated there; the group-commit "
        "writer takes the batches the loop could not commit at once. A run with refusals "
        "(503 while a replica's scrape timed out under valgrind) counts their instructions but "
        "not them, which overstates that run's figure a little. Worker: bench/worker_cpu.py's "
        "replay of 3,000 requests recorded by the baseline's edge, passes only (a run with "
        "`--no-passes` subtracted).",
        "",
        "| run | statuses | the edge's other threads, instructions per request |",
        "| --- | --- | --- |",
    ]
    for r in d.get("edge", []):
        lines.append(
            f"| {r['tree']} {r['mode']} | {r['statuses']} | "
            f"{_fmt(r['other_threads_per_request'])} |"
        )
    return lines


def render_edges(d: dict[str, Any]) -> list[str]:
    t = d.get("target_ratio")
    floods = d.get("floods")
    if floods is None:  # a result written before the wrk flood: the Python client only
        floods = [{"client": "httpx", "edges": int(n), **per} for n, per in d["edges"].items()]
    rows = [
        f"One tenant limited to {d.get('rpm')} requests/min floods N edges (`tollgate api`, "
        f"one PostgreSQL store) with {d.get('concurrency')} connections for "
        f"{_fmt(d.get('duration_s'), 0)} s: the Python client (httpx, round-robin over the "
        "edges) and wrk (one per edge). Allowed = rpm + its refill over the flood; each edge "
        "decides alone on its view of the log (other edges' admissions folded every 50 ms). "
        "The stated bound: a tenant gets past its limit by at most what the other edges admit "
        "within one propagation delay, here at most their share of the flood's answers in the "
        "longest admission-view lag an edge reported: (N − 1)/N × flood req/s × lag.",
        "",
        "| client | edges | admitted ÷ allowed (median) | over-admitted (median) | bound "
        "(median) | per run: admitted in the store / allowed (the clients' 200s) | flood req/s "
        "per run | admission-view lag at the end, s | ratio target | over-admitted ≤ bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for per in floods:
        runs = per.get("runs") or []
        ratio = per.get("ratio_median")
        within = per.get("within_bound_every_run")
        bound = _fmt(per["bound_median"], 1) if "bound_median" in per else "n/a"
        rows.append(
            f"| {per['client']} | {per['edges']} | {_fmt(ratio, 3)} | "
            f"{_fmt(per.get('over_admitted_median'), 1)} | {bound} | "
            + "; ".join(
                f"{r['admitted']} / {r['allowed']}"
                + (f" ({r['answered_200']})" if "answered_200" in r else "")
                for r in runs
            )
            + " | "
            + "; ".join(_fmt(sum(r["answers"].values()) / r["flood_s"], 0) for r in runs)
            + " | "
            + "; ".join(", ".join(_fmt(x, 3) for x in r["view_lag_s"]) for r in runs)
            + f" | ≤ {t}: {_verdict(_le(ratio, t))} | "
            + (_verdict(within) if within is not None else "n/a")
            + " |"
        )
    rows += ["", f"Load before → after: {d.get('uptime_before')} → {d.get('uptime_after')}"]
    return rows


_OVERHEAD_LABELS = {
    "direct": "direct",
    "nginx": "nginx (C proxy, no work)",
    "floor": "aiohttp floor",
    "tollgate": "Tollgate embedded",
    "distributed": "Tollgate distributed",
    "litellm": "LiteLLM",
}


def render_overhead(d: dict[str, Any]) -> list[str]:
    """The issue-31 table: every target behind one mock, added latency vs direct, CPU/request."""
    up = d.get("upstream", {})
    loads = d.get("load_average_per_run", [])
    rows = [
        f"Upstream: the cheap mock, {up.get('output_tokens')} chunks per stream, "
        f"{up.get('gap_ms')} ms between chunks (it answers at once); "
        f"{d.get('runs')} rounds × {d.get('duration_s')} s per cell, cells interleaved across "
        "targets; medians. Added p50 / p99 = target − direct in the same round, median over "
        "rounds. CPU ms/request = the target's own processes (Tollgate embedded: the edge and "
        "its fold worker; distributed: the edge, then + its relay, Kafka worker and broker; "
        "direct: the mock's own).",
        "",
        f"Load average (1, 5, 15 min) before each round: {'; '.join(map(str, loads)) or 'n/a'}; "
        f"`uptime` before: `{d.get('uptime_before', '?')}`, after: "
        f"`{d.get('uptime_after', '?')}`.",
        "",
        "| target | mode | conns | req/s | p50 ms | p99 ms | added p50 / p99 vs direct | "
        "CPU ms/request | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    cells = d.get("cells", {})
    for mode in ("json", "stream"):
        for c in d.get("connections", []):
            for name, label in _OVERHEAD_LABELS.items():
                cell = cells.get(name, {}).get(mode, {}).get(str(c))
                if cell is None:
                    continue
                added = (
                    "—" if name == "direct"
                    else f"{cell['added_p50_ms']:+.2f} / {cell['added_p99_ms']:+.2f}"
                )  # fmt: skip
                cpu = _fmt(cell["cpu_ms_per_req"], 3)
                if name == "distributed":
                    cpu = (
                        f"{_fmt(cell['edge_cpu_ms_per_req'], 3)} "
                        f"(+ {_fmt(cell['pipeline_cpu_ms_per_req'], 3)})"
                    )
                elif name == "tollgate":
                    cpu += f" (edge {_fmt(cell['edge_cpu_ms_per_req'], 3)})"
                rows.append(
                    f"| {label} | {mode} | {c} | {_fmt(cell['rps'], 0)} | "
                    f"{_fmt(cell['p50_ms'])} | {_fmt(cell['p99_ms'])} | {added} | {cpu} | "
                    f"{cell['errors_total']} |"
                )
    rows += ["", "### Targets", "", "| figure | value | target | verdict |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for key, v in d.get("verdicts", {}).items():
        target = v["target"].removeprefix("<= ")
        if key.startswith("added_p99"):
            rows.append(f"| added p99, Tollgate embedded, {key[10:]} | {_fmt(v['value_ms'])} ms "
                        f"| ≤ {target} ms | {_verdict(v['met'])} |")  # fmt: skip
        elif key.startswith("cpu_"):
            rows.append(
                f"| CPU/request, Tollgate embedded (edge + fold worker), {key[4:]} | "
                f"{_fmt(v['value_ms'], 3)} ms ({v['over_floor']}× the aiohttp floor's "
                f"{_fmt(v['floor_ms'], 3)} ms) | ≤ {target} ms | {_verdict(v['met'])} |"
            )
        elif key.startswith("distributed_"):
            runs = ", ".join(f"{r:.3f}" for r in v["ratio_runs"])
            rows.append(
                f"| edge CPU/request, distributed ÷ embedded, {key[12:]} | {_fmt(v['ratio'], 3)} "
                f"({_fmt(v['distributed_edge_ms'], 3)} vs {_fmt(v['embedded_edge_ms'], 3)} ms; "
                f"per round {runs}) | ≤ {target} | {_verdict(v['met'])} |"
            )
    # The profile and the A/B of each change, written by hand beside the script.
    notes = Path(__file__).with_name("overhead.md")
    if notes.exists():
        rows += ["", *notes.read_text().rstrip().splitlines()]
    return rows
