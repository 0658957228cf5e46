"""Instructions per request, counted by valgrind's callgrind: the architecture A/B (issue 11)
without this machine's noise.

CPU time per request on this shared 2-core VM moves by ±10 % between two runs of the same code
(paired runs of bench.gateway spread from 0.98 to 1.20 around a 5 % target); an instruction count
moves by well under 1 %. It is not CPU time — it leaves out the kernel, cache misses and branch
mispredictions — so it stands beside the wall-clock A/B, not in place of it.

Two parts, each for this checkout and the baseline commit (its own .venv, as bench.gateway
builds it):

- **edge**: `tollgate serve` under callgrind (`--separate-threads=yes`) in front of the cheap
  upstream of bench.gateway; 200 requests to warm it, the counters zeroed, then `--requests`
  requests at 16 concurrent (JSON and 16-chunk streams), the counters dumped. The figure is the
  event-loop thread's instructions per answered request. The other threads (the control-plane
  follower, the group-commit writer) poll on timers, and under valgrind a second lasts ~50 times
  longer, so their counts are shown but say little. The fold worker (a child) is not traced.
- **worker**: bench/worker_cpu.py's replay of a recorded log (3,000 requests written by the
  baseline's own edge, so both trees can read it) under callgrind, once with the passes and once
  with `--no-passes`; the difference is the fold passes' instructions.

    python -m bench.instructions --baseline-commit 4279919 [--requests 1000]

Takes ~10 minutes (measured 575 s; two valgrind processes at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS_DIR, ROOT, machine, write_result
from bench.harness import Proc, baseline_checkout, body_for, start_tollgate, start_upstream

RESULTS = RESULTS_DIR / "instructions.json"
FIXTURE_REQUESTS = 3_000


def _drive(url: str, key: str, n: int, stream: bool, concurrency: int = 16) -> dict[int, int]:
    """`n` chat completions at `concurrency`, each read to its end; their statuses."""
    body = body_for(stream)

    async def run() -> dict[int, int]:
        codes: dict[int, int] = {}
        todo = iter(range(n))
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

            async def worker() -> None:
                for _ in todo:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    ) as r:
                        async for _chunk in r.aiter_bytes():
                            pass
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return codes

    return asyncio.run(run())


def _serve(tree: Path, work: Path, upstream: str, **options: Any) -> tuple[Proc, str, str]:
    """`tollgate serve` of `tree` on a fresh data directory in `work` (limits lifted)."""
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    return start_tollgate(upstream, data, work, tree, ready_timeout_s=900, **options)


def _summary(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def edge(tree: Path, label: str, stream: bool, requests: int, work_root: Path) -> dict[str, Any]:
    mode = "stream" if stream else "json"
    work = work_root / f"edge-{label}-{mode}"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "callgrind.out"
    for old in work.glob("callgrind.out*"):
        old.unlink()
    upstream, upstream_url = start_upstream("cheap", 1.0, work)
    valgrind = (
        "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
    )  # fmt: skip
    proc = None
    try:
        proc, url, key = _serve(tree, work, upstream_url, wrapper=valgrind)
        warm = _drive(url, key, 200, stream)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        started = time.monotonic()
        codes = _drive(url, key, requests, stream)
        seconds = time.monotonic() - started
        subprocess.run(
            ["callgrind_control", "-d", "measured", str(proc.pid)], check=True,
            capture_output=True,
        )  # fmt: skip
        time.sleep(2)
    finally:
        if proc is not None:
            proc.stop()  # what was measured is already dumped
        upstream.stop()
    # The dump after zeroing is part 1: one file per thread, the event loop's first.
    parts = sorted(work.glob("callgrind.out.1-*"))
    threads = {p.name.rsplit("-", 1)[1]: _summary(p) for p in parts}
    answered = codes.get(200, 0)
    loop = threads.pop("01")
    return {
        "tree": label,
        "mode": mode,
        "requests": requests,
        "statuses": codes,
        "warm_statuses": warm,
        "seconds_under_valgrind": round(seconds, 1),
        "event_loop_instructions": loop,
        "event_loop_per_request": round(loop / max(1, answered)),
        "other_threads_per_request": round(sum(threads.values()) / max(1, answered)),
    }


def record_fixture(baseline: Path, work: Path) -> Path:
    """3,000 JSON requests through the baseline's edge with no fold worker: a log both trees read
    (the newer one upcasts; the older would refuse the newer's event versions)."""
    work.mkdir(parents=True, exist_ok=True)
    fixture = work / "fixture.db"
    upstream, upstream_url = start_upstream("cheap", 1.0, work)
    proc = None
    try:
        proc, url, key = _serve(baseline, work, upstream_url, extra_args=("--no-fold-worker",))
        codes = _drive(url, key, FIXTURE_REQUESTS, False)
        if codes != {200: FIXTURE_REQUESTS}:
            raise RuntimeError(f"fixture requests answered {codes}")
    finally:
        if proc is not None:
            proc.stop()
        upstream.stop()
    db = sqlite3.connect(work / "data" / "tollgate.db")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    shutil.copy(work / "data" / "tollgate.db", fixture)
    return fixture


def worker(tree: Path, label: str, fixture: Path, work_root: Path) -> dict[str, Any]:
    work = work_root / f"worker-{label}"
    work.mkdir(parents=True, exist_ok=True)
    script = ROOT / "bench" / "worker_cpu.py"
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the script imports the tree's folds
    args = [
        str(script), "--fixture", str(fixture), "--history", "10", "--workdir", str(work),
        "--runs", "1",
    ]  # fmt: skip
    python = str(ROOT / ".venv" / "bin" / "python")
    subprocess.run([python, *args], env=env, check=True, capture_output=True)  # the template
    totals = {}
    for passes in (True, False):
        out = work / f"callgrind-{'on' if passes else 'off'}.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, *args,
             *([] if passes else ["--no-passes"])],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        totals[passes] = _summary(out)
    passes_only = totals[True] - totals[False]
    return {
        "tree": label,
        "requests": FIXTURE_REQUESTS,
        "passes_instructions": passes_only,
        "per_request": round(passes_only / FIXTURE_REQUESTS),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-commit", default="4279919")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--parallel", type=int, default=2, help="valgrind processes at a time")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("bench.instructions needs valgrind (Debian: apt-get install valgrind)")
    baseline = baseline_checkout(args.baseline_commit)
    trees = {"tollgate": ROOT, "baseline": baseline}
    work_root = Path(tempfile.mkdtemp(prefix="tollgate-instructions-"))
    try:
        fixture = record_fixture(baseline, work_root / "fixture")
        with ThreadPoolExecutor(args.parallel) as pool:
            edges = [
                pool.submit(edge, tree, label, stream, args.requests, work_root)
                for stream in (False, True)
                for label, tree in trees.items()
            ]
            workers = [
                pool.submit(worker, tree, label, fixture, work_root)
                for label, tree in trees.items()
            ]
            edge_rows = [f.result() for f in edges]
            worker_rows = [f.result() for f in workers]
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    result = {
        "benchmark": "instructions",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.instructions " + " ".join(argv or sys.argv[1:]),
        "baseline_commit": args.baseline_commit,
        "edge": edge_rows,
        "worker": worker_rows,
    }
    write_result(args.output, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
