"""The fold worker as a child process of `tollgate serve`: started with the edge, started again
when it dies, stopped (SIGTERM, then SIGKILL) when the edge stops.

The command is the caller's: which entry point runs the worker is wiring, and this package sits
below the one that owns the CLI. The child calls `die_with_parent` first thing, so that an edge
killed with SIGKILL takes its worker with it at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("tollgate.supervisor")

# prctl(2): the signal the kernel sends a process when its parent dies.
PR_SET_PDEATHSIG = 1

# A fold worker that died is started again after this pause.
WORKER_RESTART_S = 1.0
# How long a stopping worker may take to fold what the writer flushed last.
WORKER_STOP_TIMEOUT_S = 30.0


class FoldWorkerSupervisor:
    """One fold worker child. `start()` once, `check()` periodically on one thread, `stop()` once
    after the periodic calls have ended (it waits for the child, so call it off the event loop)."""

    def __init__(
        self,
        command: list[str],
        *,
        restart_after_s: float = WORKER_RESTART_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.env = env  # None: this process's
        self.restart_after_s = restart_after_s
        self.process: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        self._stopping = False

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, env=self.env)
        self._started = time.monotonic()
        log.info("fold worker started (pid %d)", self.process.pid)

    def check(self) -> None:
        """Start the worker again if it has exited."""
        if self.process is None or self._stopping:
            return
        code = self.process.poll()
        if code is None:
            return
        if time.monotonic() - self._started < self.restart_after_s:
            return  # a worker that dies at once is not restarted in a tight loop
        log.error("fold worker exited with %s; starting it again", code)
        self.start()

    def stop(self) -> None:
        self._stopping = True
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("fold worker did not stop in %g s; killing it", WORKER_STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
        self.process = None


def die_with_parent(parent_pid: int) -> None:
    """In a supervised child: be killed (SIGKILL) by the kernel the moment `parent_pid` dies.
    A parent killed with SIGKILL cannot stop its child, and a child that only looks at its
    parent between passes folded on for a while beside the next parent's worker (a pass may be
    long, or blocked on the database). Linux only (prctl); elsewhere, and as a fallback, the
    worker's own check between passes remains.

    The parent the kernel watches is the thread that started this process: the supervisor
    starts it from the edge's event-loop thread, which lives as long as the edge."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # it died before the line above took effect
        log.warning("parent process %d is already gone; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGKILL)
