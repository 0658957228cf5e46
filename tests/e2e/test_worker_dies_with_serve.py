"""`tollgate serve` killed with SIGKILL takes its fold worker with it at once (issue 26, item 5):
the worker is not left folding beside the next server's. The worker is stopped (SIGSTOP) first,
as one busy in a long pass or blocked on the database would be: what ends it must not wait for
its own loop to look at its parent."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import FAST, MODEL, poll, running_server

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped by whoever adopted it) is not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _worker_of(serve_pid: int) -> int:
    for pid in _children(serve_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in cmdline and b"--parent-pid" in cmdline:
            return pid
    return 0


def test_a_fold_worker_dies_with_its_serve_at_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with running_server(tmp_path_factory, "worker-dies", [(MODEL, FAST)]) as server:
        assert server.proc is not None
        worker = poll("serve's fold worker", lambda: _worker_of(server.proc.pid), timeout=30)
        os.kill(worker, signal.SIGSTOP)
        try:
            server.kill9()
            # Reading /proc until the worker is gone, for at most 5 s: the kernel ends it with
            # its parent; a worker left to notice for itself stays stopped, so alive.
            deadline = time.monotonic() + 5
            while _alive(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
            alive = _alive(worker)
        finally:
            if _alive(worker):
                os.kill(worker, signal.SIGKILL)
        assert not alive, "the fold worker outlived its serve"
