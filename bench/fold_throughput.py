"""Pure fold throughput on one core: the request lifecycle's evolve over realistic 6–8-event
streams, and the edge's QuotaView.apply over the same events. Median events/s of several runs,
written to bench/results/fold_throughput.json (target: ≥ 200,000 events/s)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, write_result  # noqa: E402
from tollgate_llm.domain.control_plane.state import PLAN_LIMITS  # noqa: E402
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.quota import QuotaView  # noqa: E402
from tollgate_llm.domain.requests.events import (
    FirstTokenStreamed,
    LeaseProgress,
    LeasesRenewed,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestFailed,
    RequestRouted,
    UsageBilled,
)
from tollgate_llm.domain.requests.evolve import fold as request_fold  # noqa: E402

STREAMS = 20_000
RUNS = 7
T0 = datetime(2026, 5, 4, 12, tzinfo=UTC)


def request_events(i: int) -> list[Event]:
    """Mostly completions (7–8 events with the bill), some cancellations and failures."""
    rid = f"req-{i:08d}"
    tenant = f"tenant-{i % 50}"
    key = f"key-{i % 200}"
    model = "llama-3.1-8b-2026-05"
    prompt, out = 200 + i % 3000, 50 + i % 900
    events: list[Event] = [
        RequestAdmitted(rid, tenant, key, model, "standard", f"edge-{i % 4}", None, i % 10 == 0),
        RequestEstimated(rid, prompt, 1024, prompt + 1024, 5 * 2**30, 50_000),
        RequestRouted(rid, f"replica-{i % 16}", 420_000),
    ]
    kind = i % 10
    if kind < 8:
        events.append(FirstTokenStreamed(rid, 150))
        terminal: Event = RequestCompleted(rid, prompt, out, prompt // 2, "stop", 150, 40_000)
    elif kind == 8:
        events.append(FirstTokenStreamed(rid, 150))
        terminal = RequestCancelled(rid, prompt, out // 3, 0, "client_disconnected", True)
    else:
        terminal = RequestFailed(rid, prompt, 0, 0, "replica died")
    used = terminal.prompt_tokens + terminal.completion_tokens  # type: ignore[attr-defined]
    events += [terminal, QuotaRefunded(rid, max(0, prompt + 1024 - used), 5 * 2**30, used)]
    if kind < 9:
        events.append(
            UsageBilled(
                rid,
                tenant,
                key,
                model,
                prompt,
                used - prompt,
                0,
                200_000,
                600_000,
                50_000,
                1,
                "completed",
                T0,
                T0,
            )
        )
    return events


def build() -> list[list[Recorded]]:
    streams = []
    position = 0
    for i in range(STREAMS):
        records = []
        start = T0 + timedelta(milliseconds=i * 5)
        for version, event in enumerate(request_events(i), start=1):
            position += 1
            records.append(
                Recorded(
                    f"e{position}",
                    f"req-{i:08d}",
                    version,
                    f"tenant-{i % 50}",
                    start + timedelta(milliseconds=version * 200),
                    event,
                    position,
                )
            )
        streams.append(records)
    return streams


def bench_lifecycle(streams: list[list[Recorded]]) -> float:
    fold = request_fold
    events = sum(len(s) for s in streams)
    started = time.perf_counter()
    for records in streams:
        fold(records)
    return events / (time.perf_counter() - started)


def bench_quota(streams: list[list[Recorded]]) -> float:
    limits = PLAN_LIMITS["enterprise"]
    view = QuotaView(lambda tenant, model: limits)
    # Interleave as a bus would deliver them: by time, plus one renewal per 40 requests.
    merged = sorted((r for s in streams for r in s), key=lambda r: r.occurred_at)
    renewals = []
    for n in range(0, len(streams), 40):
        first = streams[n][0]
        progress = tuple(
            LeaseProgress(s[0].stream_id, s[0].tenant_id, 100, 10, 0) for s in streams[n : n + 40]
        )
        renewals.append(
            Recorded(
                f"renew-{n}",
                "edge-edge-0",
                n,
                first.tenant_id,
                first.occurred_at + timedelta(milliseconds=500),
                LeasesRenewed("edge-0", progress),
            )
        )
    merged = sorted(merged + renewals, key=lambda r: r.occurred_at)
    apply = view.apply
    started = time.perf_counter()
    for recorded in merged:
        apply(recorded)
    return len(merged) / (time.perf_counter() - started)


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    streams = build()
    events = sum(len(s) for s in streams)
    lifecycle_runs = [bench_lifecycle(streams) for _ in range(RUNS)]
    quota_runs = [bench_quota(streams) for _ in range(RUNS)]
    result = {
        "benchmark": "fold_throughput",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores_used": 1,
        "streams": STREAMS,
        "events": events,
        "events_per_stream_mean": round(events / STREAMS, 2),
        "runs": RUNS,
        "lifecycle_fold_events_per_s_median": round(statistics.median(lifecycle_runs)),
        "lifecycle_fold_events_per_s_runs": [round(r) for r in lifecycle_runs],
        "quota_view_apply_events_per_s_median": round(statistics.median(quota_runs)),
        "quota_view_apply_events_per_s_runs": [round(r) for r in quota_runs],
        "target_events_per_s": 200_000,
    }
    write_result(RESULTS_DIR / "fold_throughput.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
