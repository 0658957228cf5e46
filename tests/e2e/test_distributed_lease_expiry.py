"""Lease expiry in the distributed mode, every part a real process: an edge (`tollgate api`) is
SIGKILLed with streams in flight, and so is the Kafka worker leading the lease sweeper; the other
worker takes the lead, folds the dead leader's lease book again and expires each stream 15 s
after its last renewal, billed exactly the progress that renewal carried, once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import (
    SLOW,
    SLOW_MODEL,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    long_body,
    poll,
    spawn,
    start_replica,
    wait_http,
)
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
STREAMS = 3
LEADING = "leading lease-sweeper"


def test_a_dead_edges_streams_expire_once_when_the_sweepers_leader_dies_too(
    postgres_url: str, kafka_broker, kafka_topic: str, tmp_path: Path
) -> None:
    env = {
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "TOLLGATE_KAFKA_TOPIC": kafka_topic,
        "TOLLGATE_DATA_DIR": str(tmp_path / "data"),
    }
    replica = start_replica(tmp_path, SLOW_MODEL, seed=41, **SLOW)
    engine = create_engine_from_url(postgres_url)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        port = free_port()
        edge_log = tmp_path / "edge.log"
        edge = spawn(
            [*TOLLGATE, "api", "--port", str(port), "--database-url", postgres_url,
             "--replica", f"{SLOW_MODEL}={replica.url}"],
            edge_log, env=env,
        )  # fmt: skip
        processes.append(edge)
        wait_http(f"http://127.0.0.1:{port}/healthz", edge, edge_log, timeout=60)
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        workers: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        for name in ("relay", "worker-a", "worker-b"):
            log = tmp_path / f"{name}.log"
            command = "relay" if name == "relay" else "worker"
            proc = spawn([*TOLLGATE, command, "--database-url", postgres_url], log, env=env)
            processes.append(proc)
            if name != "relay":
                workers[name] = (proc, log)

        def leader() -> str | None:
            leading = [n for n, (_, log) in workers.items() if LEADING in log.read_text()]
            return leading[0] if len(leading) == 1 else None

        first = poll("one worker leading the lease sweeper", leader, timeout=60, every=0.25)

        client = httpx.Client(timeout=60)
        streams = []
        try:
            for _ in range(STREAMS):
                response = client.send(
                    client.build_request(
                        "POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                        headers=auth(keys["demo-enterprise"]),
                        json=long_body(SLOW_MODEL, 3000, stream=True),
                    ),
                    stream=True,
                )  # fmt: skip
                assert response.status_code == 200, response.read()
                lines = response.iter_lines()
                next(lines)
                # Kept: a line iterator collected closes its response (the client left).
                streams.append((response, lines))
            ids = [r.headers["x-request-id"] for r, _ in streams]

            def renewals() -> dict[str, dict[str, int]]:
                last: dict[str, dict[str, int]] = {}
                with engine.connect() as conn:
                    rows = conn.execute(sa.text(
                        "SELECT payload FROM events WHERE type = 'LeasesRenewed' "
                        "ORDER BY position"
                    )).scalars()  # fmt: skip
                    for payload in rows:
                        for p in json.loads(payload)["progress"]:
                            if p["request_id"] in ids:
                                last[p["request_id"]] = p
                return last

            poll(
                "a renewal with progress for every stream",
                lambda: all(r["completion_tokens"] > 0 for r in renewals().values())
                and len(renewals()) == STREAMS,
                timeout=30, every=0.25, detail=lambda: f"last renewals: {renewals()}",
            )  # fmt: skip
            edge.kill()  # SIGKILL: nothing renews the streams any more
            edge.wait(10)
            workers[first][0].kill()  # and the sweeper's leader dies with their leases
            workers[first][0].wait(10)
        finally:
            for response, _ in streams:
                response.close()
            client.close()
        last = renewals()  # the edge is dead: these are the last ones

        def types(rid: str) -> list[str]:
            with engine.connect() as conn:
                return list(conn.execute(
                    sa.text("SELECT type FROM events WHERE stream_id = :r ORDER BY stream_version"),
                    {"r": rid},
                ).scalars())  # fmt: skip

        def billed() -> list[dict] | None:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(
                    "SELECT request_id, prompt_tokens, completion_tokens, cached_tokens, "
                    "terminal FROM ledger_entries WHERE request_id = ANY(:ids)"
                ), {"ids": ids}).mappings().all()  # fmt: skip
            return [dict(r) for r in rows] if len(rows) == STREAMS else None

        entries = poll(
            "every stream of the dead edge expired and billed", billed, timeout=90, every=0.5
        )
        survivor = next(n for n in workers if n != first)
        assert LEADING in workers[survivor][1].read_text()
        for entry in entries:
            rid = entry["request_id"]
            seen = types(rid)
            assert seen.count("LeaseExpired") == 1 and seen.count("UsageBilled") == 1, seen
            assert seen[-3:] == ["LeaseExpired", "QuotaRefunded", "UsageBilled"], seen
            progress = last[rid]
            assert (entry["prompt_tokens"], entry["completion_tokens"], entry["cached_tokens"]) == (
                progress["prompt_tokens"], progress["completion_tokens"],
                progress["cached_tokens"],
            ), (entry, progress)  # fmt: skip
        with engine.connect() as conn:
            expired = conn.execute(
                sa.text("SELECT payload FROM events WHERE type = 'LeaseExpired'")
            ).scalars().all()
        assert len(expired) == STREAMS
    finally:
        engine.dispose()
        for proc in reversed(processes):
            _stop_process(proc, grace=10)
        replica.stop()
