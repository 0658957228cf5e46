"""The router's statistics at start-up (`ledger.quality.QualityLog`: every FeedbackRecorded of
the log folded before the edge serves), on a log of realistic size, with the event log's
(type, position) index (migration 0022) and without it (the index dropped: the log as it was
before), on SQLite and PostgreSQL.

The log: `--events` events (default 1,000,000) of requests' lifecycles, `--feedback-share` of
them (default 1 %: one request in twenty scored, five events a request) FeedbackRecorded, spread
through it. Each figure is the median of `--runs` start-ups.

    python -m bench.quality_startup [--quick] [--events 1000000] [--runs 3]
        [--backends sqlite,postgres]

Writes bench/results/quality_startup.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import RESULTS_DIR, fresh_schema, write_result

RESULTS = RESULTS_DIR / "quality_startup.json"
BATCH = 10_000


def fill(engine: sa.Engine, events: int, feedback_share: float) -> int:
    """Insert the log in bulk (the store's append path would take an hour per million here);
    returns how many FeedbackRecorded it holds."""
    from tollgate_llm.domain.registry import dumps
    from tollgate_llm.domain.requests.events import FeedbackRecorded, FirstTokenStreamed
    from tollgate_llm.ledger.schema import events as table

    t0 = datetime(2026, 5, 1, tzinfo=UTC)
    every = max(1, round(1 / feedback_share))
    other = dumps(FirstTokenStreamed("req", 12))
    feedback = 0
    rows: list[dict[str, Any]] = []
    with engine.begin() as conn:
        for i in range(events):
            rid = f"req_{i // 5:032x}"
            if i % every == every - 1:
                event: Any = FeedbackRecorded(
                    rid,
                    f"t{i % 7}",
                    "llama-3.1-8b-2026-05",
                    f"p{i % 4}.t0.ft.r0.b{i % 64}",
                    900_000,
                    "client",
                )
                payload, kind = dumps(event), event.EVENT_TYPE
                feedback += 1
            else:
                payload, kind = other, FirstTokenStreamed.EVENT_TYPE
            rows.append({
                "event_id": f"{i:036d}", "stream_id": rid, "stream_version": i % 5 + 1,
                "type": kind, "version": 1, "tenant_id": f"t{i % 7}",
                "occurred_at": t0 + timedelta(milliseconds=i), "payload": payload,
            })  # fmt: skip
            if len(rows) == BATCH:
                conn.execute(table.insert(), rows)
                rows = []
        if rows:
            conn.execute(table.insert(), rows)
    return feedback


def startup(engine: sa.Engine, runs: int) -> dict[str, Any]:
    from tollgate_llm.ledger.quality import QualityLog
    from tollgate_llm.ledger.store import SqlEventStore

    store = SqlEventStore(engine)
    seconds, folded = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        log = QualityLog(store)
        seconds.append(time.perf_counter() - t0)
        folded = len(log.view.seen)
    return {"seconds_runs": [round(s, 3) for s in seconds],
            "seconds_median": round(statistics.median(seconds), 3), "folded": folded}  # fmt: skip


def measure(url: str, events: int, share: float, runs: int) -> dict[str, Any]:
    from tollgate_llm.ledger.engine import create_engine_from_url
    from tollgate_llm.ledger.schema import upgrade

    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        started = time.perf_counter()
        feedback = fill(engine, events, share)
        loaded = time.perf_counter() - started
        with engine.begin() as conn:
            conn.execute(
                sa.text("ANALYZE" if engine.dialect.name == "sqlite" else "ANALYZE events")
            )
        indexed = startup(engine, runs)
        with engine.begin() as conn:
            conn.execute(sa.text("DROP INDEX ix_events_type_position"))
            conn.execute(
                sa.text("ANALYZE" if engine.dialect.name == "sqlite" else "ANALYZE events")
            )
        scanned = startup(engine, runs)
    finally:
        engine.dispose()
    return {
        "events": events, "feedback_events": feedback, "load_seconds": round(loaded, 1),
        "without_index": scanned, "with_index": indexed,
        "speedup": round(scanned["seconds_median"] / max(1e-9, indexed["seconds_median"]), 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--feedback-share", type=float, default=0.01)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backends", default="sqlite,postgres")
    args = ap.parse_args()
    if args.quick:
        args.events, args.runs = min(args.events, 100_000), 1
    out: dict[str, Any] = {"events": args.events, "feedback_share": args.feedback_share}
    for backend in args.backends.split(","):
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="tollgate-bench-quality-") as tmp:
                url = f"sqlite:///{Path(tmp) / 'log.db'}"
                out["sqlite"] = measure(url, args.events, args.feedback_share, args.runs)
        else:
            with fresh_schema() as url:
                out["postgres"] = measure(url, args.events, args.feedback_share, args.runs)
        print(backend, out[backend], flush=True)
    write_result(RESULTS, out)


def render(d: dict[str, Any]) -> list[str]:
    """BENCHMARKS.md's section (bench/suite.py names it as this script's renderer)."""
    rows = [
        f"A log of {d.get('events'):,} events, {d.get('feedback_share', 0) * 100:g} % of them "
        "FeedbackRecorded; `QualityLog(store)` (the router's statistics folded at start) with "
        "the (type, position) index of migration 0022 and with it dropped (the log before). "
        "Median of the runs.",
        "",
        "| backend | feedback folded | without the index | with it | speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for backend in ("sqlite", "postgres"):
        b = d.get(backend)
        if not b:
            continue
        rows.append(
            f"| {backend} | {b['with_index']['folded']:,} | "
            f"{b['without_index']['seconds_median']} s {b['without_index']['seconds_runs']} | "
            f"{b['with_index']['seconds_median']} s {b['with_index']['seconds_runs']} | "
            f"×{b['speedup']} |"
        )
    return rows


if __name__ == "__main__":
    main()
