"""`tollgate serve` runs the folds in a child process: a worker killed with -9 is started again
and billing carries on; an edge killed with -9 takes its worker with it. (A worker silent for
longer than the heartbeat limit makes /readyz fail: tests/integration/test_fold_worker.py.)"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server, short_body
from tollgate_llm.cli.pipeline import EMBEDDED_WORKER_NICENESS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lone_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "worker", [(MODEL, FAST)]) as server:
        yield server


def _completed(server: Server) -> str:
    r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(),
                   headers=auth(server.keys["demo-standard"]), timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


def _worker_pid(server: Server) -> int:
    # The newest fold worker's: a killed one's row stays (it shows as dead) until forgotten.
    newest = "SELECT pid FROM worker_status WHERE name = 'folds' ORDER BY heartbeat_at DESC"
    return int(server.query(newest)[0]["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by the edge) is not alive either.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_killed_worker_is_restarted_and_billing_carries_on(lone_server: Server) -> None:
    server = lone_server
    server.wait_billed(_completed(server))
    first = _worker_pid(server)
    assert first != server.proc.pid  # type: ignore[union-attr]
    with open(f"/proc/{first}/stat") as f:  # the edge's own child
        assert int(f.read().split(") ", 1)[1].split()[1]) == server.proc.pid  # type: ignore[union-attr]

    os.kill(first, signal.SIGKILL)
    request_id = _completed(server)  # admitted and answered while no worker runs
    second = poll("a new fold worker", lambda: (p := _worker_pid(server)) != first and p, 30)
    assert _alive(second)
    server.wait_billed(request_id, timeout=30)
    ready = httpx.get(f"{server.base}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text


def test_the_worker_runs_at_a_lower_cpu_priority_than_its_edge(lone_server: Server) -> None:
    server = lone_server
    server.wait_billed(_completed(server))
    edge = os.getpriority(os.PRIO_PROCESS, server.proc.pid)  # type: ignore[union-attr]
    worker = os.getpriority(os.PRIO_PROCESS, _worker_pid(server))
    assert worker == min(19, edge + EMBEDDED_WORKER_NICENESS)


def test_an_edge_killed_with_9_takes_its_worker_with_it(lone_server: Server) -> None:
    server = lone_server
    server.wait_billed(_completed(server))
    worker = _worker_pid(server)
    assert _alive(worker)
    server.kill9()
    poll("the orphaned worker to exit", lambda: not _alive(worker), 15)
    server.start()  # and a restarted edge bills again
    server.wait_billed(_completed(server), timeout=30)
    # The new worker writes its row just after the pass that billed, so wait for that report.
    poll("the new worker's report", lambda: _worker_pid(server) != worker, 10)
