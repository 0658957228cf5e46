"""A PostgreSQL cluster of a test's own (initdb in a temporary directory, its own port), so that
stopping or crashing it touches nobody else's database."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


class PrivateCluster:
    def __init__(self, tmp: Path, port: int, settings: str = "") -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not found:
            pytest.fail("pg_ctl is required (the PostgreSQL server package)")
        self.bin = Path(found[-1]).parent
        # Under /tmp itself: the server runs as `postgres`, which may not enter pytest's
        # private temporary directories.
        self.root = Path(f"/tmp/tollgate-pg-{uuid.uuid4().hex[:8]}")
        self.root.mkdir(mode=0o777)
        self.root.chmod(0o777)
        self.dir = self.root / "pgdata"
        self.port = port
        self.settings = settings  # extra server options, e.g. the safeguard switched off
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._run(str(self.bin / "initdb"), "-D", str(self.dir), "-A", "trust", "-U", "postgres")
        self.start()

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    def start(self) -> None:
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.dir),
            "-w",
            "-l",
            str(self.root / "pg.log"),
            "-o",
            f"-p {self.port} -k /tmp -h 127.0.0.1 {self.settings}".strip(),
            "start",
        )

    def halt(self, mode: str) -> None:
        """`pg_ctl stop -m mode`: `fast` (clients disconnected, a clean shutdown) or `immediate`
        (no checkpoint, no clean shutdown: a crash)."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir), "-m", mode, "stop")

    def crash(self) -> None:
        self.halt("immediate")

    def stop(self) -> None:
        """At the end of a test, whatever state the cluster is in."""
        subprocess.run(
            [*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.dir), "-m", "fast", "stop"],
            capture_output=True,
            timeout=60,
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def private_cluster(tmp: Path, settings: str = "") -> Iterator[PrivateCluster]:
    cluster = PrivateCluster(tmp, free_port(), settings)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
