"""Latency of one admission decision (`domain.admission.decide` over a QuotaView) in CPython on
one core: p50/p99 in µs over a realistic mix (200 tenants of one key each, refunds folded
between decisions). Writes bench/results/admission_latency.json (target: p99 ≤ 50 µs).

Limits bind tenants (domain/quota.py): at 500 decisions/s each of the 200 tenants asks 2.5 a
second, within the standard plan, so the figure is that of admissions, not of refusals."""

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
from tollgate_llm.domain.admission import Admitted, ReserveQuota, decide  # noqa: E402
from tollgate_llm.domain.control_plane.state import PLAN_LIMITS  # noqa: E402
from tollgate_llm.domain.cost import profile_for  # noqa: E402
from tollgate_llm.domain.quota import QuotaView  # noqa: E402

DECISIONS = 100_000
RUNS = 5
IN_FLIGHT = 500  # requests kept in flight; the oldest is refunded as each new one is admitted
T0 = datetime(2026, 5, 4, 12, tzinfo=UTC)


def run_once() -> tuple[list[int], int]:
    limits = PLAN_LIMITS["standard"]
    view = QuotaView(lambda tenant, model: limits)
    kv_bytes = profile_for("llama-3.1-8b").kv_bytes_per_token
    commands = [
        ReserveQuota(
            request_id=f"r{i}",
            tenant_id=f"tenant-{i % 200}",
            key_id=f"key-{i % 200}",
            model="llama-3.1-8b-2026-05",
            tier="standard",
            edge_id="edge-0",
            prompt_tokens=200 + (i * 37) % 3000,
            max_tokens=256 + (i * 11) % 1024,
            kv_bytes_per_token=kv_bytes,
            tpot_us=50_000,
            now=T0 + timedelta(microseconds=i * 2_000),  # 500 decisions/s
            jitter=(i % 1000) / 1000,
            is_retry=i % 20 == 0,
        )
        for i in range(DECISIONS)
    ]
    samples: list[int] = []
    admitted: list[tuple[str, datetime]] = []
    clock = time.perf_counter_ns
    for cmd in commands:
        started = clock()
        decision = decide(view, cmd, limits)
        samples.append(clock() - started)
        if isinstance(decision, Admitted):
            admitted.append((cmd.request_id, cmd.now))
            if len(admitted) > IN_FLIGHT:
                rid, _ = admitted.pop(0)
                view.refund(rid, used_tokens=500, at=cmd.now)
    return samples, len(admitted)


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    p50s, p99s, p999s = [], [], []
    for _ in range(RUNS):
        samples, _ = run_once()
        samples.sort()
        n = len(samples)
        p50s.append(samples[n // 2] / 1000)
        p99s.append(samples[int(n * 0.99)] / 1000)
        p999s.append(samples[int(n * 0.999)] / 1000)
    result = {
        "benchmark": "admission_latency",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores_used": 1,
        "decisions_per_run": DECISIONS,
        "runs": RUNS,
        "p50_us_median": round(statistics.median(p50s), 2),
        "p99_us_median": round(statistics.median(p99s), 2),
        "p999_us_median": round(statistics.median(p999s), 2),
        "p99_us_runs": [round(v, 2) for v in p99s],
        "target_p99_us": 50,
    }
    write_result(RESULTS_DIR / "admission_latency.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
