"""CPU per PostgreSQL group commit: `SqlEventStore.append_many` on one thread, as the writer
thread of the distributed edge calls it, on a fresh migrated schema. Three cases: one admission
(a new stream, 2 events), one end (3 events at an expected version: the versions are read under
the lock) and four admissions in one group. N commits a repeat, R repeats, the best of R
(process CPU time, which the shared machine's load moves less than wall time).

Run it against a code tree with PYTHONPATH (it imports whatever tree is first), interleaving
the trees of an A/B over a few rounds:

    PYTHONPATH=/tmp/other-tree .venv/bin/python bench/pg_commit.py [--commits 300] [--repeats 5]

Prints one JSON line: per case, [CPU ms, wall ms] per commit.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import fresh_schema
from bench.store_append import request_events
from tollgate_llm.domain.requests.events import FirstTokenStreamed
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.store import AppendBatch, SqlEventStore


def request(n: int) -> tuple[AppendBatch, AppendBatch]:
    """One JSON request's two group commits, from the store benchmark's realistic events: its
    admission (RequestAdmitted, RequestEstimated) as a new stream, and its end at version 2
    (routed, completed, refunded)."""
    events = request_events(n)
    rid = events[0].stream_id
    ends = [e for e in events[2:] if not isinstance(e.event, FirstTokenStreamed)]
    return AppendBatch(rid, 0, events[:2]), AppendBatch(rid, 2, ends)


def _groups(store: SqlEventStore, case: str, n: int) -> list[list[AppendBatch]]:
    requests = [request(i) for i in range(n * 4)]
    if case == "end":
        for admitted, _ in requests[:n]:
            store.append_many([admitted])
        return [[ended] for _, ended in requests[:n]]
    if case == "admission":
        return [[admitted] for admitted, _ in requests[:n]]
    return [[admitted for admitted, _ in requests[4 * i : 4 * i + 4]] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out: dict[str, list[float]] = {}
    with fresh_schema() as url:
        engine = create_engine_from_url(url)
        store = SqlEventStore(engine)
        for i in range(20):  # warm up: connections, prepared statements
            for batch in request(i):
                store.append_many([batch])
        for case in ("admission", "end", "four_admissions"):
            best: tuple[float, float] | None = None
            for _ in range(args.repeats):
                groups = _groups(store, case, args.commits)
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for batches in groups:
                    results = store.append_many(batches)
                    assert all(r.ok for r in results), results
                cpu = (time.process_time() - cpu0) / args.commits * 1000
                wall = (time.perf_counter() - wall0) / args.commits * 1000
                if best is None or cpu < best[0]:
                    best = (cpu, wall)
            assert best is not None
            out[case] = [round(best[0], 4), round(best[1], 4)]
        engine.dispose()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
