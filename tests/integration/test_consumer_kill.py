"""SIGKILL of the embedded fold worker at each named crash point (ledger/faults.py) while events
keep arriving: 20,000+ events, ≥ 20 kills, then one clean pass to the end. Held: every ended
request billed exactly once (0 lost, 0 applied twice, in the events and in the read models), and
events were redelivered after the kills (> 0: the crashes landed between an effect and its
checkpoint). With the safeguard off — the billing checkpoint saved before the bills — the same
test must find lost bills.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest, RouteRequest
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import (
    ledger_entries,
    projection_checkpoints,
    request_log,
    upgrade,
    usage_hourly,
)
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.worker import FoldWorker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b-2026-05"
COMPLETION_TOKENS = 42
EVENTS_PER_REQUEST = 5  # admitted, estimated, routed, completed, refunded
SAFE_POINTS = (
    "fold.after_read",
    "billing.after_append",
    "projections.before_commit",
    "projections.after_commit",
)


def _request(store: SqlEventStore) -> str:
    rid = "req_" + uuid.uuid4().hex
    at = datetime.now(UTC)
    events = b.decided(
        AdmitRequest(
            rid, "acme", "key-1", MODEL, "standard", "edge-1", Estimate(100, 50, 1_000, 40_000)
        ),
        RouteRequest("replica-1", 0, request_id=rid),
        CompleteRequest(100, COMPLETION_TOKENS, 0, "stop", 30, 20_000, request_id=rid),
        at=at,
    )
    assert len(events) == EVENTS_PER_REQUEST
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "acme", at, e) for e in events])
    return rid


class Appender(threading.Thread):
    """Requests arriving while workers die: one every `every_s` until `minimum` are in, then a
    trickle (the kills' crash points need new events) until told to stop."""

    def __init__(self, store: SqlEventStore, minimum: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.store, self.minimum, self.every_s = store, minimum, every_s
        self.ids: list[str] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not (self.done.is_set() and len(self.ids) >= self.minimum):
                self.ids.append(_request(self.store))
                time.sleep(self.every_s if len(self.ids) < self.minimum else 0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _min_checkpoint(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.min(projection_checkpoints.c.position))).scalar() or 0
        )


def _run_child(url: str, points: str, unsafe: bool, log: Path) -> tuple[int, int | None]:
    """One worker until it kills itself at its crash point (or 30 s): (returncode, position it
    died at)."""
    args = [sys.executable, "-m", "tests.faults.fold_worker_child", "--database-url", url]
    env = {"TOLLGATE_FAULT_POINTS": points}

    with open(log, "ab") as out:
        proc = subprocess.Popen(
            args + (["--checkpoint-first"] if unsafe else []),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.terminate()
            code = proc.wait(30)
    died = re.findall(
        rb"fault point \S+ hit \d+: SIGKILL pid %d position=(\d+)" % proc.pid, log.read_bytes()
    )
    return code, int(died[-1]) if died else None


@pytest.mark.parametrize("safeguard", ["on", "off"])
def test_the_fold_worker_killed_at_each_crash_point_loses_and_repeats_nothing(
    sqlite_url: str, tmp_path: Path, safeguard: str
) -> None:
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    store = SqlEventStore(engine)
    at = datetime.now(UTC) - timedelta(days=1)
    price = NewEvent(
        str(uuid.uuid4()), f"prices-{MODEL}", "", at, PriceSet(MODEL, 150_000, 600_000, 0, at)
    )
    store.append(price.stream_id, 0, [price])
    FoldWorker(engine).catch_up()  # the checkpoint rows exist before the first kill
    kills_wanted = 21 if safeguard == "on" else 4
    minimum = 4_000 if safeguard == "on" else 300
    appender = Appender(store, minimum, every_s=0.002 if safeguard == "on" else 0.01)
    appender.start()
    rng = random.Random(14)
    kills = redelivered = 0
    log = tmp_path / "workers.log"
    points = SAFE_POINTS if safeguard == "on" else ("billing.after_checkpoint",)
    for i in range(kills_wanted):
        point = points[i % len(points)]
        code, position = _run_child(
            sqlite_url, f"{point}@{rng.randint(1, 2)}", safeguard == "off", log
        )
        if code == -9:
            kills += 1
            if position is not None:
                redelivered += max(0, position - _min_checkpoint(engine))
    appender.done.set()
    appender.join(120)
    assert appender.error is None, appender.error
    final = FoldWorker(engine)  # the safe worker, to the end
    final.catch_up()
    for _ in range(3):
        final.run_pass()

    ids = set(appender.ids)
    with engine.connect() as conn:
        bills = dict(
            conn.execute(
                sa.text(
                    "SELECT stream_id, count(*) FROM events WHERE type = 'UsageBilled' "
                    "GROUP BY stream_id"
                )
            ).all()
        )
        events = conn.execute(sa.text("SELECT count(*) FROM events")).scalar()
        ledger_rows = conn.execute(sa.select(sa.func.count()).select_from(ledger_entries)).scalar()
        usage = conn.execute(
            sa.select(
                sa.func.sum(usage_hourly.c.requests), sa.func.sum(usage_hourly.c.completion_tokens)
            )
        ).one()
        logged = conn.execute(
            sa.select(sa.func.count())
            .select_from(request_log)
            .where(request_log.c.status == "completed")
        ).scalar()
    engine.dispose()
    lost = len(ids - set(bills))
    duplicated = sum(n - 1 for n in bills.values() if n > 1)
    violations = []
    if ledger_rows != len(ids) - lost:
        violations.append(f"{ledger_rows} ledger rows for {len(ids) - lost} bills")
    if tuple(usage) != (len(ids) - lost, (len(ids) - lost) * COMPLETION_TOKENS):
        violations.append(f"usage_hourly sums {tuple(usage)}: a bill applied twice or not at all")
    if logged != len(ids):
        violations.append(f"{logged} completed rows in request_log for {len(ids)} requests")
    print(
        f"consumer kill (safeguard {safeguard}): operations {len(ids)} requests, {events} events "
        f"/ faults injected {kills} SIGKILLs at {', '.join(points)} / lost {lost} / duplicated "
        f"{duplicated} / invariant violations {len(violations)}; redelivered {redelivered} events"
    )
    if safeguard == "off":
        assert lost > 0, "with the checkpoint saved before the bills, a kill must lose bills"
        return
    assert kills >= 20 and events >= 20_000
    assert (lost, duplicated, violations) == (0, 0, [])
    assert redelivered > 0
