"""The fold worker's supervisor on a real child process: a child that dies is started again, a
stopped supervisor starts nothing, and stop ends the child (SIGTERM). `tollgate serve` with the
real worker: tests/e2e/test_fold_worker.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

import pytest

from tollgate_llm.streams.supervisor import FoldWorkerSupervisor

# Stands in for `tollgate worker`: runs until signalled.
CHILD = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


def wait_for(what: str, fn: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def test_a_dead_worker_is_started_again_and_stop_ends_it() -> None:
    supervisor = FoldWorkerSupervisor(CHILD, restart_after_s=0.0)
    supervisor.start()
    try:
        first = supervisor.process
        assert first is not None and first.poll() is None
        supervisor.check()
        assert supervisor.process is first  # alive: left alone

        os.kill(first.pid, signal.SIGKILL)
        wait_for("the child to die", lambda: first.poll() is not None)
        supervisor.check()
        second = supervisor.process
        assert second is not None and second is not first and second.poll() is None
    finally:
        supervisor.stop()
    assert supervisor.process is None
    assert second.returncode == -signal.SIGTERM


def test_a_worker_that_dies_at_once_waits_before_it_is_started_again() -> None:
    supervisor = FoldWorkerSupervisor([sys.executable, "-c", "pass"], restart_after_s=3600.0)
    supervisor.start()
    first = supervisor.process
    assert first is not None
    wait_for("the child to exit", lambda: first.poll() is not None)
    supervisor.check()
    assert supervisor.process is first  # no restart in a tight loop
    supervisor.stop()


def test_after_stop_nothing_is_started() -> None:
    supervisor = FoldWorkerSupervisor(CHILD, restart_after_s=0.0)
    supervisor.start()
    supervisor.stop()
    supervisor.check()
    assert supervisor.process is None
