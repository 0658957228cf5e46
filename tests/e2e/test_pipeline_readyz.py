"""An edge's /readyz shows a stale pipeline: an edge over PostgreSQL with its fold worker as a
process of its own, the staleness threshold set to 2 s; embedded (`tollgate serve
--no-fold-worker` + the SQL-tail `tollgate worker`) and distributed (`tollgate api`, the relay
and a Kafka `tollgate worker` on the real broker). The worker is killed with requests to bill:
503 naming the worker's old heartbeat and the events after its position, and `tollgate status`
exits 2; a worker starts again and catches up: 200, nothing stale on the edge, every request
billed, and `tollgate status` lists the new worker caught up beside the killed one, STALE."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import (
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    poll,
    spawn,
    wait_http,
)
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
STALE_S = "2"


def _complete(base: str, key: str, i: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}],
            "max_tokens": 8}
    r = httpx.post(f"{base}/v1/chat/completions", headers=auth(key), json=body, timeout=30)
    assert r.status_code == 200, r.text


def _status(url: str, env: dict[str, str], *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [*TOLLGATE, "status", "--database-url", url, *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr
    return done.returncode, done.stdout


@pytest.mark.parametrize("mode", ["sql-tail", pytest.param("kafka", marks=pytest.mark.kafka)])
def test_readyz_is_503_while_the_worker_is_stopped_and_200_once_it_caught_up(
    mode: str, postgres_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env |= {"TOLLGATE_DATA_DIR": str(tmp_path / "data"), "TOLLGATE_PIPELINE_STALE_S": STALE_S}
    if mode == "kafka":
        broker = request.getfixturevalue("kafka_broker")
        env |= {"TOLLGATE_KAFKA_BOOTSTRAP": broker.bootstrap,
                "TOLLGATE_KAFKA_TOPIC": request.getfixturevalue("kafka_topic")}
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    worker_args = [*TOLLGATE, "worker", "--database-url", postgres_url,
                   "--metrics-port", str(metrics_port)]
    edge_command = ["api"] if mode == "kafka" else ["serve", "--no-fold-worker"]
    edge = spawn(
        [*TOLLGATE, *edge_command, "--port", str(port), "--database-url", postgres_url,
         "--simulated-replicas", "1", "--sim-speed", "20"],
        tmp_path / "edge.log", env=env,
    )  # fmt: skip
    relay = worker = None
    engine = create_engine_from_url(postgres_url)

    def ready() -> httpx.Response:
        return httpx.get(f"{base}/readyz", timeout=10)

    def ledger() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM ledger_entries")).scalar())

    try:
        wait_http(f"{base}/healthz", edge, tmp_path / "edge.log", timeout=90)
        # After the edge migrated the store: each process runs the migrations at its start.
        if mode == "kafka":
            relay_args = [*TOLLGATE, "relay", "--database-url", postgres_url]
            relay = spawn(relay_args, tmp_path / "relay.log", env=env)
        worker = spawn(worker_args, tmp_path / "worker.log", env=env)
        try:
            poll("the edge ready", lambda: ready().status_code == 200, timeout=90, every=0.5)
        except pytest.fail.Exception:
            pytest.fail(f"the edge is not ready: {ready().text}")
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        key = keys["demo-enterprise"]
        for i in range(3):
            _complete(base, key, i)
        poll("3 requests billed", lambda: ledger() == 3, timeout=30)
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "tollgate_billing_lag_seconds_count 3.0" in scrape

        killed = worker.pid
        worker.kill()  # a clean stop would delete its row: this one goes silent
        worker.wait(15)
        for i in range(3, 8):
            _complete(base, key, i)
        def unready() -> str:
            r = ready()
            problems = " | ".join(r.json()["problems"]) if r.status_code == 503 else ""
            # Both go stale after 2 s, each on its own clock: the heartbeat from the worker's
            # last report, the lag from the oldest event after the reported position (in Kafka
            # mode the sweeper's, which may be behind the worker's own last bills).
            named = "event(s) after its position" in problems and "last reported" in problems
            return problems if named else ""

        problems = poll(
            "/readyz 503 naming the silent worker and the unfolded events", unready,
            timeout=30, every=0.5,
        )  # fmt: skip
        assert "pipeline: worker folds:" in problems, problems
        assert ledger() == 3
        code, out = _status(postgres_url, env)
        assert code == 2 and "STALE:" in out and "event(s) after its position" in out

        worker = spawn(worker_args, tmp_path / "worker.log", env=env)
        poll("/readyz 200", lambda: ready().status_code == 200, timeout=60, every=0.5)
        poll("8 requests billed", lambda: ledger() == 8, timeout=30)

        def caught_up() -> tuple[int, list[dict[str, object]]] | None:
            code, out = _status(postgres_url, env, "--json")
            listed = json.loads(out)["workers"]
            live = [w["lag_events"] for w in listed if w["pid"] == worker.pid]
            return (code, listed) if live == [0] else None

        code, listed = poll("tollgate status: the worker caught up", caught_up, timeout=30,
                            every=0.5)  # fmt: skip
        assert code == 2 and [w["pid"] for w in listed if w["stale"]] == [killed]
        poll("/readyz without problems", lambda: ready().json()["problems"] == [], timeout=30)
    finally:
        engine.dispose()
        if worker is not None:
            _stop_process(worker, grace=10)
        if relay is not None:
            _stop_process(relay, grace=10)
        _stop_process(edge, grace=10)
