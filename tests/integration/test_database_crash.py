"""Database crashes (issue 14): requests appended and folded while the database goes down hard —
SQLite: the writer and the fold worker SIGKILLed mid-write; PostgreSQL: a private cluster the
test creates on its own port, stopped with `pg_ctl stop -m immediate` (no checkpoint, no clean
shutdown) and started again. 10 crashes each. Held: every request whose append was acknowledged
is in the log with all its events (0 acknowledged-then-missing), and no read-model row exists
without the events it was folded from.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.pg_cluster import PrivateCluster
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.worker import FoldWorker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CRASHES = 10
MODEL = "llama-3.1-8b-2026-05"


def _spawn(module: str, url: str, out: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", module]
    args += [url] if module.endswith("appender_child") else ["--database-url", url]
    return subprocess.Popen(args, cwd=ROOT, stdout=open(out, "ab"), stderr=subprocess.DEVNULL)  # noqa: SIM115


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


# The safeguard switched off: a commit acknowledged before its WAL is written (flushed within
# a second), so a crash loses what was acknowledged since.
UNSAFE = "-c synchronous_commit=off -c wal_writer_delay=1000ms"


@pytest.fixture(params=["sqlite", "postgres", "postgres-safeguard-off"])
def database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, PrivateCluster | None]]:
    tmp = tmp_path_factory.mktemp("dbcrash")
    if request.param == "sqlite":
        yield "sqlite", f"sqlite:///{tmp / 'tollgate.db'}", None
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = PrivateCluster(tmp, port, UNSAFE if request.param.endswith("-off") else "")
    try:
        yield request.param, cluster.url, cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def test_acknowledged_writes_survive_hard_database_crashes(
    database: tuple[str, str, PrivateCluster | None], tmp_path: Path
) -> None:
    kind, url, cluster = database
    upgrade(url)
    engine = create_engine_from_url(url)
    store = SqlEventStore(engine)
    at = datetime.now(UTC) - timedelta(days=1)
    price = NewEvent(
        str(uuid.uuid4()), f"prices-{MODEL}", "", at, PriceSet(MODEL, 150_000, 600_000, 0, at)
    )
    store.append(price.stream_id, 0, [price])
    engine.dispose()
    acked = tmp_path / "acked.txt"
    rng = random.Random(14)
    writer = _spawn("tests.faults.appender_child", url, acked)
    worker = _spawn("tests.faults.fold_worker_child", url, tmp_path / "worker.log")
    try:
        for _ in range(CRASHES):
            # Past the children's start (seconds of imports on a busy machine), then a while.
            size = acked.stat().st_size if acked.exists() else 0
            deadline = time.monotonic() + 60
            while (acked.stat().st_size if acked.exists() else 0) == size:
                assert time.monotonic() < deadline, "the writer acknowledged nothing for 60 s"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.2, 1.0))
            if cluster is None:  # SQLite: the processes die mid-write; the file stays
                _kill(writer)
                _kill(worker)
                writer = _spawn("tests.faults.appender_child", url, acked)
                worker = _spawn("tests.faults.fold_worker_child", url, tmp_path / "worker.log")
            else:
                cluster.crash()
                time.sleep(rng.uniform(0.1, 0.5))
                cluster.start()
        time.sleep(1.0)
    finally:
        _kill(writer)
        _kill(worker)
    acknowledged = [line for line in acked.read_text().splitlines() if line.startswith("req_")]
    engine = create_engine_from_url(url)
    try:
        final = FoldWorker(engine)
        final.catch_up()
        final.run_pass()
        with engine.connect() as conn:
            counts = dict(
                conn.execute(
                    sa.text(
                        "SELECT stream_id, count(*) FROM events WHERE stream_id LIKE 'req_%' "
                        "AND type <> 'UsageBilled' GROUP BY stream_id"
                    )
                ).all()
            )
            orphans = conn.execute(
                sa.text(
                    "SELECT count(*) FROM ledger_entries l WHERE NOT EXISTS (SELECT 1 FROM "
                    "events e WHERE e.stream_id = l.request_id AND e.type = 'UsageBilled')"
                )
            ).scalar()
            orphans += conn.execute(
                sa.text(
                    "SELECT count(*) FROM request_log r WHERE NOT EXISTS (SELECT 1 FROM events e "
                    "WHERE e.stream_id = r.request_id AND e.type = 'RequestAdmitted')"
                )
            ).scalar()
            if kind == "sqlite":
                assert conn.execute(sa.text("PRAGMA integrity_check")).scalar() == "ok"
    finally:
        engine.dispose()
    missing = [rid for rid in acknowledged if counts.get(rid) != 5]
    print(
        f"database crash ({kind}): operations {len(acknowledged)} acknowledged requests, "
        f"{sum(counts.values())} events / faults injected {CRASHES} "
        f"{'SIGKILLs of writer and worker' if cluster is None else 'pg_ctl stop -m immediate'} "
        f"/ lost {len(missing)} / duplicated 0 / invariant violations {orphans}"
    )
    assert len(acknowledged) > 100
    if kind.endswith("-off"):
        assert missing, "acknowledged commits not yet in the WAL should be lost: proves nothing"
        return
    assert missing == [] and orphans == 0
