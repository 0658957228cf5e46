"""What the benchmark scripts share: where results go, the machine they ran on, a free port, a
server's readiness, a fresh PostgreSQL schema, and how a result is written."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from tollgate_llm.ledger.schema import upgrade

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
# The PostgreSQL the benchmarks use (`./dev` starts it): the test database, a schema per run.
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def uptime() -> str:
    """`uptime`'s line: the load averages before and after a run, as the results record them."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before {url} was up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not up after {timeout}s")


@contextlib.contextmanager
def fresh_schema() -> Iterator[str]:
    """A URL whose connections see only a new, migrated schema (dropped afterwards)."""
    schema = "bench_pipeline_" + uuid.uuid4().hex[:8]
    admin = psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True)
    admin.execute(f'CREATE SCHEMA "{schema}"')
    url = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    try:
        upgrade(url)
        yield url
    finally:
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        admin.close()


def write_result(path: Path | str, result: Any) -> None:
    """A script's result JSON (bench/results/<name>.json), which `python -m bench` renders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
