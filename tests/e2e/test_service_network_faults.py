"""Network faults between services (issue 14): `tollgate api` reaches PostgreSQL only through one
TCP proxy (tests/faults/proxy.py) and `tollgate worker` through another, while clients stream
and not through the edge. The proxies cycle through latency, a black hole and resets, the edge's
and the worker's in turn and at once. Each operation is recorded ok / failed / unknown by its
client; the final read, straight from PostgreSQL, resolves every one. Held: every admitted
request has one terminal event, one refund and one bill (0 double bills), and every answer a
client received complete is billed exactly the engine count it was shown (0 lost
acknowledgements), even when the store's connection was reset under the append that ended it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.e2e.conftest import MODEL, TOLLGATE, _stop_process, auth, free_port, spawn, wait_http
from tests.faults.clients import Operation, chat
from tests.faults.proxy import FaultyProxy
from tests.faults.tier import LONG
from tollgate_llm.domain.requests.events import TERMINAL_TYPES

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.slow]

# (the edge's proxy, the pipeline's proxies: the worker's and the relay's, seconds)
SCHEDULE = (
    ("pass", "pass", 2.0), ("latency", "pass", 1.5), ("reset", "pass", 0.3),
    ("pass", "reset", 0.3), ("pass", "pass", 1.5), ("blackhole", "pass", 2.0),
    ("pass", "blackhole", 2.0), ("reset", "reset", 0.3), ("pass", "pass", 1.5),
    ("latency", "latency", 1.5), ("reset", "pass", 0.3), ("pass", "pass", 3.0),
)  # fmt: skip
CLIENTS = 6
TERMINALS = tuple(sorted(TERMINAL_TYPES))




def _through(url: str, port: int) -> str:
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


def _conninfo(url: str) -> str:
    u = make_url(url)
    options = u.query.get("options", "")
    return (f"host={u.host} port={u.port or 5432} user={u.username} dbname={u.database} "
            f"options={options}")  # fmt: skip


def _one(base: str, secret: str, op: Operation, i: int) -> None:
    body = {"model": MODEL, "max_tokens": 20 + i % 30,
            "messages": [{"role": "user", "content": f"Count to {i}."}]}  # fmt: skip
    chat(base, auth(secret), op, body)


# (pipeline, safeguard): the safeguard-off twin, an edge that never sends a batch again once the
# store dropped it, in the long tier only (tests/faults/tier.py).
CASES = [
    pytest.param("sql", "on", id="sql"),
    pytest.param("kafka", "on", id="kafka", marks=pytest.mark.kafka),
    *([pytest.param("sql", "off", id="sql-safeguard-off")] if LONG else []),
]


@pytest.mark.parametrize(("pipeline", "safeguard"), CASES)
def test_faults_between_the_edge_the_worker_and_postgresql_lose_and_double_nothing(
    pipeline: str,
    safeguard: str,
    postgres_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """`sql`: the worker tails the SQL log. `kafka`: `tollgate relay` and a Kafka worker, each
    through a proxy of its own to PostgreSQL (the broker reached directly). Safeguard off: the
    same run must find answers billed other than as shown (their ends lost, then expired)."""
    pg_port = make_url(postgres_url).port or 5432
    edge_proxy, worker_proxy = FaultyProxy(pg_port), FaultyProxy(pg_port)
    relay_proxy = FaultyProxy(pg_port)  # used by the kafka pipeline only
    env = {"TOLLGATE_DATA_DIR": str(tmp_path / "data")}
    if pipeline == "kafka":
        broker = request.getfixturevalue("kafka_broker")
        env["TOLLGATE_KAFKA_BOOTSTRAP"] = broker.bootstrap
        env["TOLLGATE_KAFKA_TOPIC"] = request.getfixturevalue("kafka_topic")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    edge_log, worker_log = tmp_path / "edge.log", tmp_path / "worker.log"
    cli = TOLLGATE if safeguard == "on" else [sys.executable, "-m", "tests.faults.edge_child"]
    edge = spawn([*cli, "api", "--port", str(port), "--database-url",
                  _through(postgres_url, edge_proxy.port), "--simulated-replicas", "1",
                  "--sim-speed", "20"], edge_log, env=env)  # fmt: skip
    worker: subprocess.Popen[bytes] | None = None
    relay: subprocess.Popen[bytes] | None = None
    ops: list[Operation] = []
    try:
        wait_http(f"{base}/healthz", edge, edge_log, timeout=60)
        worker_url = _through(postgres_url, worker_proxy.port)
        worker = spawn([*TOLLGATE, "worker", "--database-url", worker_url], worker_log, env=env)
        if pipeline == "kafka":
            relay_url = _through(postgres_url, relay_proxy.port)
            relay = spawn([*TOLLGATE, "relay", "--database-url", relay_url],
                          tmp_path / "relay.log", env=env)  # fmt: skip
        secret = json.loads((tmp_path / "data" / "demo-keys.json").read_text())[
            "demo-enterprise"
        ]
        lock, done = threading.Lock(), threading.Event()

        def client(c: int) -> None:
            i = 0
            while not done.is_set():
                op = Operation(stream=(c + i) % 2 == 0)
                _one(base, secret, op, i)
                with lock:
                    ops.append(op)
                i += 1

        threads = [threading.Thread(target=client, args=(c,), daemon=True)
                   for c in range(CLIENTS)]  # fmt: skip
        for t in threads:
            t.start()
        for edge_mode, worker_mode, seconds in SCHEDULE:
            edge_proxy.set_mode(edge_mode)
            worker_proxy.set_mode(worker_mode)
            relay_proxy.set_mode(worker_mode)
            time.sleep(seconds)
        for proxy in (edge_proxy, worker_proxy, relay_proxy):
            proxy.set_mode("pass")
        done.set()
        for t in threads:
            t.join(60)

        # The final read, straight from PostgreSQL: every admitted request ended, refunded
        # and billed once (a request whose end was lost is expired by the sweeper meanwhile).
        with psycopg.connect(_conninfo(postgres_url), autocommit=True) as conn:
            deadline = time.monotonic() + 90
            while True:
                rows = conn.execute(
                    "SELECT stream_id, "
                    " count(*) FILTER (WHERE type = 'RequestAdmitted'), "
                    " count(*) FILTER (WHERE type = ANY(%s)), "
                    " count(*) FILTER (WHERE type = 'QuotaRefunded'), "
                    " count(*) FILTER (WHERE type = 'UsageBilled'), "
                    " (SELECT count(*) FROM ledger_entries l WHERE l.request_id = e.stream_id) "
                    "FROM events e WHERE stream_id LIKE 'req_%%' GROUP BY stream_id",
                    (list(TERMINALS),),
                ).fetchall()
                admitted = {r[0] for r in rows if r[1]}
                problems = [f"{r[0]}: {r[1:]}" for r in rows
                            if r[1] and tuple(r[1:]) != (1, 1, 1, 1, 1)
                            or not r[1] and any(r[2:])]  # fmt: skip
                if not problems or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            ledger = {
                r[0]: (r[1], r[2])
                for r in conn.execute(
                    "SELECT request_id, completion_tokens, terminal FROM ledger_entries"
                )
            }
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        retries = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("tollgate_event_append_retries_total"))  # fmt: skip
    finally:
        for proc in (edge, worker, relay):
            if proc is not None:
                _stop_process(proc)
        for proxy in (edge_proxy, worker_proxy, relay_proxy):
            proxy.close()

    lost_acks = [
        (op.request_id, op.completion_tokens, ledger.get(op.request_id or ""))
        for op in ops
        if op.outcome == "ok"
        and (ledger.get(op.request_id or "") or (None,))[0] != op.completion_tokens
    ]
    unresolved = [op.request_id for op in ops if op.outcome == "unknown"
                  and op.request_id in admitted and op.request_id not in ledger]  # fmt: skip
    counts = {k: sum(op.outcome == k for op in ops) for k in ("ok", "failed", "unknown")}
    resets = edge_proxy.resets + worker_proxy.resets + relay_proxy.resets
    print(
        f"service network faults ({pipeline}, safeguard {safeguard}): operations {len(ops)} "
        f"({counts}) / faults injected "
        f"{len(SCHEDULE)} phases, {resets} connections reset / lost {len(lost_acks)} / "
        f"duplicated {sum(' 2' in p for p in problems)} / invariant violations "
        f"{len(problems) + len(unresolved)}; {len(admitted)} admitted, {retries:.0f} appends "
        f"sent again after the store dropped them"
    )
    assert counts["ok"] > 0 and resets > 0, (counts, resets)
    if safeguard == "off":
        assert lost_acks or problems or unresolved, "the unsafe edge lost nothing: a blind test"
        return
    assert problems == [], problems[:10]
    assert lost_acks == [], lost_acks[:10]
    assert unresolved == []
