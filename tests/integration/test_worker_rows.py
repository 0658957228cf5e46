"""One `worker_status` row per worker process: the members of a Kafka consumer group each report
their own (pid, host, partitions, last batch), `tollgate status` lists them all, a killed member
shows as stale (exit 2) while the edges' readiness follows the live ones, a clean stop deletes
its row, and a row long dead is forgotten."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.integration import test_kafka_worker
from tests.integration.test_kafka_worker import PARTITIONS, _price, _Relaying, _requests, _worker
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade, worker_status
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.status import FORGET_AFTER_S, read_status
from tollgate_llm.streams.worker_rows import read_fold_status, write_status_row

ROOT = Path(__file__).resolve().parents[2]
engine = test_kafka_worker.engine  # the migrated PostgreSQL store's engine (a fixture)


def _rows(engine: sa.Engine, name: str = "folds") -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [
            dict(r)
            for r in conn.execute(
                sa.select(worker_status).where(worker_status.c.name == name)
            ).mappings()
        ]


def _status(url: str, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "tollgate_llm.cli", "status", "--database-url", url, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr
    return done.returncode, done.stdout


def _poll(what: str, check: Any, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.postgres
@pytest.mark.kafka
@pytest.mark.slow
def test_each_member_of_a_group_has_its_row_and_a_killed_one_is_stale(
    engine: sa.Engine, postgres_url: str, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    store = SqlEventStore(engine)
    _price(store)
    relay = _Relaying(engine, kafka_broker.bootstrap, kafka_topic)
    workers = [
        _worker(postgres_url, kafka_broker.bootstrap, kafka_topic, tmp_path / f"w{i}.log")
        for i in range(2)
    ]
    try:

        def split() -> list[dict[str, Any]] | None:
            _requests(store, 20, random.Random(len(_rows(engine))))
            rows = _rows(engine)
            parts = [set(map(int, r["partitions"].split(","))) for r in rows if r["partitions"]]
            both = len(parts) == 2 and parts[0] | parts[1] == set(range(PARTITIONS))
            batched = all(r["last_batch_at"] is not None for r in rows)
            return rows if both and not parts[0] & parts[1] and batched else None

        rows = _poll("both members reporting their own partitions", split)
        assert {r["pid"] for r in rows} == {w.pid for w in workers}
        assert {r["member"] for r in rows} == {f"{r['host']}:{r['pid']}" for r in rows}
        # Exactly one leads the sweeper, so exactly one has a store position.
        assert sorted(r["position"] is None for r in rows) == [False, True]
        code, out = _status(postgres_url, "--json")
        listed = [w for w in json.loads(out)["workers"] if w["name"] == "folds"]
        assert sorted(w["pid"] for w in listed) == sorted(w.pid for w in workers)
        assert not any(w["stale"] for w in listed)

        killed, kept = workers
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        dead = f"worker folds (pid {killed.pid} on "

        def stale() -> tuple[int, str] | None:
            found = _status(postgres_url, "--stale-after", "8")
            return found if dead in found[1] else None

        code, out = _poll("the killed member stale", stale)
        assert code == 2 and "dead or hung" in out
        assert f"worker folds (pid {kept.pid} on " not in out
        # The edges' readiness follows the live member: the group took the partitions over.
        assert read_fold_status(engine, datetime.now(UTC), stale_s=8).problems == ()
        later = datetime.now(UTC) + timedelta(seconds=FORGET_AFTER_S + 60)
        assert killed.pid not in {w.pid for w in read_status(engine, later).workers}

        kept.send_signal(signal.SIGTERM)  # a clean stop deletes its own row
        assert kept.wait(30) == 0
        assert [r["pid"] for r in _rows(engine)] == [killed.pid]
    finally:
        relay.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)


def test_a_new_process_deletes_its_names_forgotten_rows_and_not_the_others(
    sqlite_url: str,
) -> None:
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    now = datetime.now(UTC)

    def row(member: str, age_s: float, name: str = "folds") -> dict[str, Any]:
        return {
            "name": name, "member": member, "pid": int(member.split(":")[1]), "host": "h",
            "heartbeat_at": now - timedelta(seconds=age_s), "position": 0, "billing_lag": 0,
            "error": None, "dead_letters": 0,
        }  # fmt: skip

    try:
        write_status_row(engine, row("h:1", FORGET_AFTER_S + 5))
        write_status_row(engine, row("h:2", 30))
        write_status_row(engine, row("h:3", FORGET_AFTER_S + 5, name="batch-runner"))
        assert read_fold_status(engine, now, stale_s=10).problems == (
            "folds: the fold worker (pid 2) last reported 30 s ago",
        )
        write_status_row(engine, row("h:4", 0))
        assert sorted(r["member"] for r in _rows(engine)) == ["h:2", "h:4"]
        assert [r["member"] for r in _rows(engine, "batch-runner")] == ["h:3"]
        assert read_fold_status(engine, now, stale_s=10).problems == ()
        listed = read_status(engine, now, stale_s=10).workers
        assert [(w.member, w.stale) for w in listed] == [("h:2", True), ("h:4", False)]
    finally:
        engine.dispose()
