"""The distributed mode end to end, every part a real process: two edges (`tollgate api`) in
front of two simulated replicas, the relay, two Kafka workers, one PostgreSQL store, the real
Kafka-protocol broker. A mixed run through both edges (completed, streamed, clients leaving
mid-stream, engine failures) ends with exactly one ledger entry per admitted request and the
ledger's token totals equal to the replicas' own."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import (
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    free_port,
    poll,
    spawn,
    start_replica,
    wait_http,
)
from tests.e2e.test_mixed_run import one
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
REQUESTS = 400
CONCURRENCY = 16
FAST = {"speed": 20, "step_base_ms": 10, "mean_output_tokens": 24}


@dataclass
class Edge:
    port: int
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _cli(url: str, *args: str) -> None:
    done = subprocess.run(
        [*TOLLGATE, *args, "--database-url", url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_two_edges_relay_and_two_workers_bill_every_request_once(
    postgres_url: str, kafka_broker, kafka_topic: str, tmp_path: Path
) -> None:
    rng = random.Random(2026_12_02)
    env = {
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "TOLLGATE_KAFKA_TOPIC": kafka_topic,
        "TOLLGATE_DATA_DIR": str(tmp_path / "data"),
    }
    replicas = [start_replica(tmp_path, MODEL, seed=31 + i, **FAST) for i in range(2)]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        edges = [Edge(free_port()), Edge(free_port())]
        for i, edge in enumerate(edges):  # the first seeds the demo tenants; both serve them
            args = [*TOLLGATE, "api", "--port", str(edge.port), "--database-url", postgres_url]
            args += [a for r in replicas for a in ("--replica", f"{r.model}={r.url}")]
            log = tmp_path / f"edge-{i}.log"
            proc = spawn([*args, *(["--no-demo"] if i else [])], log, env=env)
            processes.append(proc)
            wait_http(f"{edge.base}/healthz", proc, log, timeout=60)
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        for edge in edges:
            edge.keys = keys
        for tenant in ("demo-free", "demo-standard"):
            _cli(
                postgres_url,
                "limits",
                "set",
                "--tenant",
                tenant,
                "--model",
                "*",
                "--rpm",
                "100000",
                "--tpm",
                "100000000",
            )
        for name, args in [
            ("relay", ["relay"]),
            ("worker-a", ["worker"]),
            ("worker-b", ["worker"]),
        ]:
            processes.append(
                spawn(
                    [*TOLLGATE, *args, "--database-url", postgres_url],
                    tmp_path / f"{name}.log",
                    env=env,
                )
            )

        async def run_all() -> list[tuple]:
            sem = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(timeout=60) as client:

                async def guarded(i: int) -> tuple:
                    async with sem:
                        return await one(client, edges[i % 2], i, rng)  # type: ignore[arg-type]

                return await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))

        results = asyncio.run(run_all())
        statuses = Counter((kind, status) for kind, status, _ in results)
        assert all(status in (200, 429, 499, 502, 503) for _, status, _ in results), statuses
        assert statuses[("disconnect", 499)] and statuses[("fail_json", 502)], statuses

        engine = create_engine_from_url(postgres_url)
        try:

            def counts() -> tuple[int, int]:
                with engine.connect() as conn:
                    admitted = conn.execute(
                        sa.text("SELECT count(*) FROM events WHERE type = 'RequestAdmitted'")
                    ).scalar()
                    entries = conn.execute(sa.text("SELECT count(*) FROM ledger_entries")).scalar()
                return int(admitted or 0), int(entries or 0)

            poll(
                "every admitted request billed",
                lambda: (c := counts())[0] == c[1] or None,
                timeout=120,
                every=0.5,
            )
            with engine.connect() as conn:
                ledger = conn.execute(
                    sa.text(
                        "SELECT sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens), "
                        "count(*), count(DISTINCT request_id) FROM ledger_entries"
                    )
                ).one()
                bills = conn.execute(
                    sa.text(
                        "SELECT count(*), count(DISTINCT stream_id) FROM events "
                        "WHERE type = 'UsageBilled'"
                    )
                ).one()
                edges_seen = conn.execute(
                    sa.text(
                        "SELECT count(DISTINCT payload::json->>'edge_id') FROM events "
                        "WHERE type = 'RequestAdmitted'"
                    )
                ).scalar()
        finally:
            engine.dispose()
        admitted, entries = counts()
        assert entries == admitted >= REQUESTS * 0.9
        assert ledger[3] == ledger[4] == bills[0] == bills[1] == admitted
        assert edges_seen == 2
        stats = [r.stats() for r in replicas]
        assert all(s["running"] == 0 and s["waiting"] == 0 for s in stats), stats
        engine_totals = tuple(
            sum(s[k] for s in stats)
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "requests")
        )
        assert (ledger[0], ledger[1], ledger[2], ledger[3]) == engine_totals
    finally:
        for proc in reversed(processes):
            _stop_process(proc, grace=10)
        for r in replicas:
            r.stop()
