"""Fold worker CPU per request on SQLite, replayed from a recorded log.

The fixture is a SQLite database written by `tollgate serve --no-fold-worker` under load (no
bills, no read models): e.g. 3,000 non-streaming requests (llama-3.1-8b-2026-05, max_tokens 16,
16 concurrent, `--sim-speed 20`) driven by bench/drive_load.py, the server stopped, the WAL
checkpointed. Each run starts from an empty migrated database (with `--history K`: K earlier
copies of the fixture's requests already in the log, ids shifted back in time, each with a bill
under a random id as uuid5 gave, the folds' checkpoints at its end; a live log holds millions of
events) and replays the fixture's events into it as the edge did, ~300 events at a time (cut
only between two streams' appends), running one `FoldWorker.run_pass()` (default batch 500)
after each chunk, as the live worker does every 100 ms at ~500 req/s: a pass reads ~300 edge
events plus the ~50 bills the previous pass appended. Only the passes are timed
(time.process_time: user + system); the feeding is not. The sweeper's clock follows the
replayed log (else every replayed lease would look expired).

Run it against a code tree with PYTHONPATH (the script imports whatever tree is first):

    PYTHONPATH=/tmp/wk-worker .venv/bin/python bench/worker_cpu.py \
        --fixture /tmp/wk-data/fixture.db --history 40 --workdir /tmp/wk-data/bench --runs 5 \
        [--profile /tmp/prof.out] [--chunk 300] [--wal-autocheckpoint N]

Prints JSON lines: one per run (cpu_us_per_request, wall, passes) and a summary (median).

CPU time on this machine varies by ±15 % from run to run; instruction counts do not. For an A/B
of the passes alone, run each tree under `valgrind --tool=callgrind` twice, with and without
`--no-passes`, and subtract the totals (the feeding, the imports and the start-up cancel out).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

import tollgate_llm.streams.worker as worker_mod
from tollgate_llm.domain.projections import PROJECTIONS
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.streams.worker import FoldWorker

COLS = (
    "event_id, stream_id, stream_version, type, version, tenant_id, occurred_at, payload, "
    "recorded_at"
)


class _Clock(datetime):
    """datetime with a settable now(): the sweeper's clock follows the replayed log."""

    at: datetime = datetime.now(UTC)

    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return cls.at


def _embedded_worker(engine: Any) -> FoldWorker:
    """The worker as `tollgate serve` starts it: no /metrics port, so no billing-lag histogram
    (a tree from before the pipeline metrics takes no such argument)."""
    try:
        from tollgate_llm.streams.metrics import PipelineMetrics
    except ImportError:
        return FoldWorker(engine)
    return FoldWorker(engine, metrics=PipelineMetrics(billing=False))


def _template(workdir: str, fixture_path: str, history: int) -> str:
    """An empty migrated database, or with `history` earlier copies of the fixture's requests
    (ids shifted back in time, each with a bill): a live database holds millions of events, and
    how an append touches the indexes depends on their size."""
    path = os.path.join(workdir, f"template-h{history}.db")
    if os.path.exists(path):
        return path
    tmp = path + ".tmp"
    upgrade(f"sqlite:///{tmp}")
    if history:
        _write_history(tmp, fixture_path, history)
    os.replace(tmp, path)
    return path


def _shift(uuid7: str, ms_back: int) -> str:
    """A UUIDv7 (with or without dashes) `ms_back` milliseconds earlier."""
    h = uuid7.replace("-", "")
    h = f"{int(h[:12], 16) - ms_back:012x}" + h[12:]
    return h if "-" not in uuid7 else f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _write_history(path: str, fixture_path: str, copies: int) -> None:
    import uuid

    fx = sqlite3.connect(fixture_path)
    rows = fx.execute(
        f"SELECT {COLS} FROM events WHERE stream_id LIKE 'req_%' ORDER BY position"
    ).fetchall()
    fx.close()
    bill_payload = (
        '{"amount_micros":12,"cached_micros_per_mtok":0,"cached_tokens":0,'
        '"completion_micros_per_mtok":600000,"completion_tokens":16,"key_id":"k",'
        '"model":"llama-3.1-8b-2026-05","price_version":1,"prompt_micros_per_mtok":150000,'
        '"prompt_tokens":16,"request_id":"r","tenant_id":"t","terminal":"completed"}'
    )
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("BEGIN")
    position = 0
    for k in range(copies, 0, -1):
        back = k * 3_600_000  # an hour per copy, oldest first
        out = []
        for event_id, stream_id, sv, type_, version, tenant, at, payload, rec in rows:
            sid = "req_" + _shift(stream_id[4:], back)
            position += 1
            out.append(
                (
                    position,
                    _shift(event_id, back),
                    sid,
                    sv,
                    type_,
                    version,
                    tenant,
                    at,
                    payload,
                    rec,
                )
            )
            if type_ == "QuotaRefunded":  # its bill, with a random id as uuid5 gives
                position += 1
                out.append(
                    (
                        position,
                        str(uuid.uuid4()),
                        sid,
                        sv + 1,
                        "UsageBilled",
                        1,
                        tenant,
                        at,
                        bill_payload,
                        rec,
                    )
                )
        db.executemany(f"INSERT INTO events (position, {COLS}) VALUES (?,?,?,?,?,?,?,?,?,?)", out)
    # The folds are caught up with the history (as a live worker is); its read-model rows are
    # not written (the replayed requests touch none of them).
    for name in (*(spec.name for spec in PROJECTIONS), "billing"):
        db.execute(
            "INSERT INTO projection_checkpoints (name, position, updated_at) VALUES (?, ?, ?)",
            (name, position, "2026-01-01 00:00:00.000000"),
        )
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def _chunks(fixture: sqlite3.Connection, size: int) -> list[tuple[int, int]]:
    rows = fixture.execute("SELECT position, stream_id FROM events ORDER BY position").fetchall()
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(rows):
        j = min(i + size, len(rows)) - 1
        while j + 1 < len(rows) and rows[j + 1][1] == rows[j][1]:
            j += 1  # never split one stream's append
        out.append((rows[i][0], rows[j][0]))
        i = j + 1
    return out


def run_once(
    fixture_path: str,
    workdir: str,
    chunk: int,
    profile: cProfile.Profile | None,
    history: int,
    engine_kw: dict | None = None,
    passes_on: bool = True,
) -> dict[str, float]:
    engine_kw = engine_kw or {}
    db = os.path.join(workdir, "run.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    shutil.copy(_template(workdir, fixture_path, history), db)
    feed = sqlite3.connect(db, isolation_level=None)
    feed.execute("PRAGMA journal_mode=WAL")
    feed.execute("PRAGMA synchronous=NORMAL")
    feed.execute("PRAGMA busy_timeout=10000")
    feed.execute("PRAGMA wal_autocheckpoint=10000")  # the edge checkpoints only past ~40 MB
    feed.execute("ATTACH DATABASE ? AS fx", (fixture_path,))
    fx = sqlite3.connect(fixture_path)
    chunks = _chunks(fx, chunk)
    requests = fx.execute("SELECT count(*) FROM events WHERE type = 'RequestAdmitted'").fetchone()[
        0
    ]
    last_at = dict(fx.execute("SELECT position, occurred_at FROM events").fetchall())
    fx.close()

    def feed_chunk(lo: int, hi: int) -> None:
        feed.execute("BEGIN IMMEDIATE")
        base = feed.execute("SELECT coalesce(max(position), 0) FROM main.events").fetchone()[0]
        feed.execute(
            f"INSERT INTO main.events (position, {COLS}) SELECT ? + row_number() OVER "
            f"(ORDER BY position), {COLS} FROM fx.events WHERE position BETWEEN ? AND ? "
            "ORDER BY position",
            (base, lo, hi),
        )
        feed.execute("COMMIT")
        _Clock.at = datetime.fromisoformat(last_at[hi]).replace(tzinfo=UTC)

    original = worker_mod.datetime
    worker_mod.datetime = _Clock  # type: ignore[misc]
    try:
        engine = create_engine_from_url(f"sqlite:///{db}", **engine_kw)
        # Start-up as `tollgate worker` does, once the control plane is in the log.
        feed_chunk(*chunks[0])
        w = _embedded_worker(engine)
        w.catch_up()
        cpu = 0.0
        wall = 0.0
        passes = 0
        read = 0
        for span in [*chunks[1:], None, None, None]:  # then the last bills
            if span is not None:
                feed_chunk(*span)
            c0, t0 = time.process_time(), time.perf_counter()
            if profile is not None:
                profile.enable()
            read += w.run_pass() if passes_on else 0
            if profile is not None:
                profile.disable()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
            passes += 1
        billed = feed.execute(
            "SELECT count(*) FROM main.events WHERE type = 'UsageBilled'"
        ).fetchone()[0]
        if w.errors:
            raise SystemExit(f"fold errors: {w.errors}")
        engine.dispose()
    finally:
        worker_mod.datetime = original  # type: ignore[misc]
        feed.close()
    return {
        "cpu_us_per_request": cpu / requests * 1e6,
        "cpu_us_per_event": cpu / max(read, 1) * 1e6,
        "cpu_s": cpu,
        "wall_s": wall,
        "passes": passes,
        "events_read": read,
        "events_per_pass": read / passes,
        "requests": requests,
        "billed": billed,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fixture", default="/tmp/wk-data/fixture.db")
    p.add_argument("--workdir", default=None)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--chunk", type=int, default=300)
    p.add_argument(
        "--history",
        type=int,
        default=0,
        help="earlier copies of the fixture's requests already in the log",
    )
    p.add_argument("--profile", default=None, help="cProfile output path (all runs)")
    p.add_argument("--label", default="")
    p.add_argument(
        "--no-passes",
        action="store_true",
        help="feed the log but run no pass: under an instruction counter (valgrind "
        "--tool=callgrind), a run with passes minus this one is the passes' exact cost",
    )
    p.add_argument(
        "--wal-autocheckpoint",
        type=int,
        default=None,
        help="experiment: the worker engine's wal_autocheckpoint (default: the code's)",
    )
    args = p.parse_args()
    from tollgate_llm import streams
    workdir = args.workdir or tempfile.mkdtemp(prefix="worker-cpu-")
    profile = cProfile.Profile() if args.profile else None
    results = []
    for _ in range(args.runs):
        kw = (
            {}
            if args.wal_autocheckpoint is None
            else {"wal_autocheckpoint": args.wal_autocheckpoint}
        )
        r = run_once(
            args.fixture, workdir, args.chunk, profile, args.history, kw, not args.no_passes
        )
        results.append(r)
        print(json.dumps({"label": args.label, **{k: round(v, 2) for k, v in r.items()}}))
    if profile is not None:
        profile.dump_stats(args.profile)
    med = statistics.median(r["cpu_us_per_request"] for r in results)
    print(
        json.dumps(
            {
                "label": args.label,
                "tree": os.path.dirname(os.path.dirname(streams.__file__)),
                "median_cpu_us_per_request": round(med, 1),
                "runs": [round(r["cpu_us_per_request"], 1) for r in results],
            }
        )
    )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
