"""Network faults between the edge and its replica (issue 14): a TCP proxy (tests/faults/proxy.py)
in front of the only replica cycles through latency, a black hole and resets while clients send
streamed and non-streamed requests. Each operation is recorded ok / failed / unknown by the
client; the final read of the log and the ledger resolves every one. Held: every admitted
request has one terminal event, one refund and one bill (0 double bills); every answer a client
received complete is billed exactly the engine count it was shown (0 lost acknowledgements).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, start_replica
from tests.faults.clients import Operation, chat
from tests.faults.proxy import FaultyProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCHEDULE = (("pass", 2.0), ("latency", 2.0), ("blackhole", 3.0), ("pass", 1.5), ("reset", 0.5),
            ("latency", 1.5), ("reset", 0.5), ("pass", 3.0))  # fmt: skip
CLIENTS = 6




@pytest.fixture(scope="module")
def behind_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, FaultyProxy]]:
    tmp = tmp_path_factory.mktemp("network")
    replica = start_replica(tmp, MODEL, seed=3, **FAST)
    proxy = FaultyProxy(replica.port)
    server = Server(tmp, [replica])
    # The edge reaches the replica only through the proxy.
    server.serve_args = ["--replica", f"{MODEL}=http://127.0.0.1:{proxy.port}"]
    server.replicas = []
    try:
        server.start()
        server.replicas = [replica]
        yield server, proxy
    finally:
        server.stop()
        replica.stop()
        proxy.close()


def _one(server: Server, secret: str, op: Operation, i: int) -> None:
    body = {"model": MODEL, "max_tokens": 40 + i % 50,
            "messages": [{"role": "user", "content": f"Count to {i}."}]}  # fmt: skip
    chat(server.base, auth(secret), op, body)


def test_latency_black_holes_and_resets_lose_and_double_nothing(
    behind_proxy: tuple[Server, FaultyProxy],
) -> None:
    server, proxy = behind_proxy
    tenant = server.new_tenant("netfault", "enterprise", rpm=100_000, tpm=10_000_000)
    ops: list[Operation] = []
    lock = threading.Lock()
    done = threading.Event()

    def client(c: int) -> None:
        i = 0
        while not done.is_set():
            op = Operation(stream=(c + i) % 2 == 0)
            _one(server, tenant.secret, op, i)
            with lock:
                ops.append(op)
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for mode, seconds in SCHEDULE:
        proxy.set_mode(mode)
        time.sleep(seconds)
    proxy.set_mode("pass")
    done.set()
    for t in threads:
        t.join(60)

    server.wait_all_billed(timeout=60)
    admitted = [
        r["stream_id"]
        for r in server.query(
            "SELECT stream_id FROM events WHERE type = 'RequestAdmitted' AND tenant_id = ?",
            (tenant.name,),
        )
    ]
    problems = server.lifecycle_problems(admitted)
    lost_acks = []
    for op in ops:
        if op.outcome != "ok":
            continue
        entry = server.ledger(op.request_id or "")
        if entry is None or entry["completion_tokens"] != op.completion_tokens:
            lost_acks.append((op.request_id, op.completion_tokens, entry and dict(entry)))
    unresolved = [
        op
        for op in ops
        if op.outcome == "unknown"
        and op.request_id is not None
        and op.request_id in admitted
        and server.ledger(op.request_id) is None
    ]
    counts = {k: sum(op.outcome == k for op in ops) for k in ("ok", "failed", "unknown")}
    print(
        f"network faults: operations {len(ops)} ({counts}) / faults injected "
        f"{len(SCHEDULE)} phases, {proxy.resets} connections reset / lost {len(lost_acks)} / "
        f"duplicated {sum('terminal' in p or 'billed' in p for p in problems)} / invariant "
        f"violations {len(problems) + len(unresolved)}; {len(admitted)} admitted, all resolved "
        f"by the final read"
    )
    assert counts["ok"] > 0 and (counts["failed"] + counts["unknown"]) > 0, counts
    assert problems == [] and lost_acks == [] and unresolved == []
