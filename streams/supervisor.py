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
# A child that keeps dying young waits twice as long each time, up to this.
RESTART_MAX_S = 30.0
# A child that ran this long before it died was healthy: its next wait starts over.
HEALTHY_AFTER_S = 30.0
# How long a stopping worker may take to fold what the writer flushed last.
WORKER_STOP_TIMEOUT_S = 30.0


class RestartBackoff:
    """How long after its start a child that exited may be started again: `first_s`, and twice
    as long for each death in a row within `healthy_after_s` of its start, up to `max_s` — a
    child that dies at once (a bad setting, a database that refuses it) is not restarted in a
    tight loop, and one that ran a while is restarted at once."""

    def __init__(
        self,
        first_s: float = WORKER_RESTART_S,
        max_s: float = RESTART_MAX_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
    ) -> None:
        self.first_s, self.max_s, self.healthy_after_s = first_s, max_s, healthy_after_s
        self.young_deaths = 0

    def after_exit(self, ran_s: float) -> float:
        """The wait, counted from the child's start, before starting it again; once per exit."""
        if ran_s >= self.healthy_after_s:
            self.young_deaths = 0
            return self.first_s
        self.young_deaths += 1
        return min(self.max_s, self.first_s * 2 ** (self.young_deaths - 1))


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
        self.backoff = RestartBackoff(restart_after_s)
        self._started = 0.0
        self._restart_at: float | None = None  # set when its exit was seen
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
        now = time.monotonic()
        if self._restart_at is None:
            wait_s = self.backoff.after_exit(now - self._started)
            self._restart_at = self._started + wait_s
            log.error("fold worker exited with %s; starting it again %g s after its start",
                      code, wait_s)  # fmt: skip
        if now < self._restart_at:
            return
        self._restart_at = None
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
