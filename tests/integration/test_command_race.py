"""The control plane's optimistic concurrency, with real processes: eight `tollgate tenants
create acme` at once register the tenant exactly once; the other seven say it exists.

Each process is the real CLI (its own interpreter, its own connection). The test holds each one's
first decision at a gate until all eight have loaded their view of the control plane, so the
decisions overlap instead of being spread out by process start-up: without the gate the race is
real but rare, with it the old code (which appended at the stream's current version rather than
the version it had decided on) registered the tenant several times on every run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tollgate_llm.domain.audit.events import ChangeAudited
from tollgate_llm.domain.control_plane.events import TenantRegistered
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import SqlEventStore

PROCESSES = 8
GATED = """
import os, sys, time
import tollgate_llm.api.services.control_service as service
gate = sys.argv[1]
decide, first = service.decide_control, [True]

def gated(view, command):
    if first.pop() if first else False:
        open(gate + "." + str(os.getpid()), "w").close()
        while not os.path.exists(gate):
            time.sleep(0.001)
    return decide(view, command)

service.decide_control = gated
from tollgate_llm.cli import main
main(["tenants", "create", "acme", "--plan", "free", "--database-url", sys.argv[2]])
"""


def test_concurrent_creates_register_one_tenant(url: str, tmp_path: Path) -> None:
    upgrade(url)
    gate = tmp_path / "gate"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GATED, str(gate), url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(PROCESSES)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("gate.*"))) < PROCESSES:
        assert time.monotonic() < deadline, "the processes did not reach their decision"
        time.sleep(0.01)
    gate.touch()
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]

    created = [r for r in results if r[0] == 0]
    refused = [r for r in results if r[0] != 0]
    assert len(created) == 1, results
    assert "created" in created[0][1]
    for _, _, err in refused:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "exists" in lines[0], err  # one clear line, no traceback

    engine = create_engine_from_url(url)
    try:
        stream = SqlEventStore(engine).read_stream("tenant-acme")
    finally:
        engine.dispose()
    registered = [r for r in stream if isinstance(r.event, TenantRegistered)]
    # The one registration and its audit record, appended together.
    assert len(registered) == 1 and [type(r.event) for r in stream] == [
        TenantRegistered, ChangeAudited
    ]
