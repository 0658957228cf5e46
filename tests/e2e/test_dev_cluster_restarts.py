"""`tollgate dev-cluster` restarts what dies (issue 26, item 5): a worker, the relay, an edge and
the broker killed with SIGKILL while clients keep sending requests through the front address are
started again (with back-off), every request through the front succeeds (the front passes over
the dead edge), and every request is billed once when the killed parts are back (the broker
comes back empty: the relay publishes the store again)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import MODEL, dev_cluster, poll
from tests.e2e.test_dev_cluster import _alive, _started
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
KILLED = ("worker-1", "relay", "edge-1", "kafka")


def test_dev_cluster_restarts_a_killed_worker_relay_and_edge(
    postgres_url: str, tmp_path: Path
) -> None:
    with dev_cluster(postgres_url, tmp_path, "--simulated-replicas", "1", grace=60) as cluster:
        port, proc, out, banner = cluster.port, cluster.proc, cluster.out, cluster.banner
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        pids = {name: int(pid) for name, pid in re.findall(r"^  (\S+) .*pid (\d+)\)?$", banner,
                                                          re.M)}  # fmt: skip
        assert set(KILLED) <= set(pids), banner
        # Each process by its pid and start time: a pid is reused once its process is gone.
        born = {name: _started(pids[name]) for name in KILLED}

        front = f"http://127.0.0.1:{port}"
        answers: list[tuple[int, str, float]] = []  # status, request id, sent at
        stopping = threading.Event()

        def clients() -> None:
            body = {"model": MODEL, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Say something short."}]}  # fmt: skip
            headers = {"Authorization": f"Bearer {keys['demo-standard']}"}
            while not stopping.is_set():
                # A new connection each time: each is a new choice of edge by the front.
                sent_at = time.monotonic()
                try:
                    r = httpx.post(f"{front}/v1/chat/completions", json=body, headers=headers,
                                   timeout=30)  # fmt: skip
                    answers.append((r.status_code, r.headers.get("x-request-id", ""), sent_at))
                except httpx.HTTPError as exc:
                    answers.append((0, type(exc).__name__, sent_at))
                time.sleep(0.05)

        sender = threading.Thread(target=clients, daemon=True)
        sender.start()
        try:
            time.sleep(1.0)
            for name in KILLED:
                os.kill(pids[name], signal.SIGKILL)
            killed_at = time.monotonic()
            for name in KILLED:
                poll(f"{name} started again",
                     lambda name=name: f"dev-cluster: started {name} again" in out.read_text(),
                     timeout=60, every=0.5)  # fmt: skip
            restarted = {
                name: int(pid)
                for name, pid in re.findall(r"started (\S+) again \(pid (\d+)\)", out.read_text())
            }
            reborn = {name: _started(pid) for name, pid in restarted.items()}
            # The restarted edge answers again, and clients keep going through the front.
            poll("edge-1 back", lambda: _answers(f"http://127.0.0.1:{port + 1}"), timeout=90)
            time.sleep(2.0)
        finally:
            stopping.set()
            sender.join(60)
        failed = [a for a in answers if a[0] != 200]
        ok = {rid for status, rid, _ in answers if status == 200}
        # Only a request in flight on the edge when it was killed may fail (its connection
        # went with it); every one sent after the kill goes to an edge that is up.
        after = [a for a in answers if a[2] > killed_at]
        print(f"dev-cluster restarts: {len(answers)} requests through the front while "
              f"{', '.join(KILLED)} were killed and restarted: {len(failed)} failed, "
              f"{sum(a[0] != 200 for a in after)} of {len(after)} sent after the kill")  # fmt: skip
        assert [a for a in after if a[0] != 200] == [] and len(after) > 20
        assert len(failed) <= 1  # one client, one request at a time
        # Each came back once and runs: a part that died again after its restart is named,
        # with what the supervisor said, and the end of its log.
        said = out.read_text()
        again = [name for name, _ in re.findall(r"started (\S+) again \(pid (\d+)\)", said)]
        dead = [name for name in KILLED if not _alive(restarted[name], reborn[name])]
        assert sorted(again) == sorted(KILLED) and dead == [], (
            f"restarted: {again}, not running: {dead}\n{said.removeprefix(banner)}\n"
            + "\n".join(_log_tail(tmp_path, name) for name in sorted(set(again) | set(dead)))
        )
        assert not any(_alive(pids[name], born[name]) for name in KILLED)

        engine = create_engine_from_url(postgres_url)
        try:

            def billed() -> set[str] | None:
                with engine.connect() as conn:
                    ids = set(conn.execute(sa.text("SELECT request_id FROM ledger_entries"))
                              .scalars())  # fmt: skip
                return ids if ok <= ids else None

            ids = poll("every request billed", billed, timeout=120, every=0.5)
            with engine.connect() as conn:
                doubled = conn.execute(sa.text(
                    "SELECT count(*) FROM (SELECT stream_id FROM events WHERE type = "
                    "'UsageBilled' GROUP BY stream_id HAVING count(*) > 1) d"
                )).scalar()  # fmt: skip
        finally:
            engine.dispose()
        assert ok <= ids and doubled == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, out.read_text()[-3000:]
        assert not any(_alive(pid, reborn[name]) for name, pid in restarted.items())


def _log_tail(tmp_path: Path, name: str) -> str:
    log = tmp_path / "logs" / ("broker.log" if name == "kafka" else f"{name}.log")
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    return f"--- {log.name}:\n{tail}"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
