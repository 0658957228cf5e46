"""`tollgate dev-cluster` as a user runs it: one command starts the broker, the fleet, the relay,
two Kafka workers, the batch runner and two edges behind one address; requests through both edges
and that address with the official openai SDK are billed exactly once in the PostgreSQL ledger,
to the fleet's own counts; a batch created through the front completes; `tollgate status` lists
each worker process; a child that dies is reported; SIGTERM stops every child."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from openai import OpenAI

from tests.e2e.conftest import MODEL, TOLLGATE, dev_cluster, poll
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
REQUESTS = 40


def _alive(pid: int, started: int | None = None) -> bool:
    """Whether process `pid` runs (a zombie, not reaped yet, is dead too); with `started`, the
    process that had that start time (`_started`): a pid is reused once its process is gone, and
    pid_max is 32768 here, where a loaded CI run starts thousands of processes a minute."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and started in (None, int(fields[19]))


def _started(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), None if there is none."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field (the state) on: the name before it may hold
    spaces and parentheses."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def test_dev_cluster_bills_both_edges_once_and_stops_every_child(
    postgres_url: str, tmp_path: Path
) -> None:
    with dev_cluster(postgres_url, tmp_path, "--simulated-replicas", "2",
                     "--log-format", "json", grace=60) as cluster:  # fmt: skip
        port, proc, out, banner = cluster.port, cluster.proc, cluster.out, cluster.banner
        # The front address and the two edges behind it.
        edges = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}",
                 f"http://127.0.0.1:{port}"]  # fmt: skip
        for edge in edges:
            assert edge in banner
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        assert keys["demo-standard"] in banner and keys["finance"] in banner
        pids = {name: int(pid) for name, pid in re.findall(r"^  (\S+) .*pid (\d+)\)?$", banner,
                                                          re.M)}  # fmt: skip
        assert {"edge-1", "edge-2", "relay", "worker-1", "worker-2", "batch-runner",
                "kafka"} <= set(pids), banner  # fmt: skip
        replicas = re.findall(r"^  replica-\S+\s+(http://\S+)", banner, re.M)
        assert len(replicas) == 2, banner

        usage = [0, 0, 0]
        request_ids, through_front = set(), set()
        for i in range(REQUESTS):
            client = OpenAI(base_url=f"{edges[i % 3]}/v1", api_key=keys["demo-standard"],
                            max_retries=0, timeout=30)  # fmt: skip
            messages = [{"role": "user", "content": f"Say something short, number {i}."}]
            if i % 2:  # every other request streamed, on every address
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                )
                request_ids.add(raw.headers["x-request-id"])
                if i % 3 == 2:
                    through_front.add(raw.headers["x-request-id"])
                got = raw.parse().usage
            else:
                with client.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=messages, max_tokens=16, stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True},
                ) as response:
                    request_ids.add(response.headers["x-request-id"])
                    if i % 3 == 2:
                        through_front.add(response.headers["x-request-id"])
                    got = [c for c in response.parse() if c.usage][-1].usage
            assert got is not None
            cached = got.prompt_tokens_details.cached_tokens if got.prompt_tokens_details else 0
            usage = [usage[0] + got.prompt_tokens, usage[1] + got.completion_tokens,
                     usage[2] + (cached or 0)]  # fmt: skip
        assert len(request_ids) == REQUESTS

        engine = create_engine_from_url(postgres_url)
        try:

            def ledger() -> sa.Row | None:
                with engine.connect() as conn:
                    row = conn.execute(sa.text(
                        "SELECT count(*), count(DISTINCT request_id), sum(prompt_tokens), "
                        "sum(completion_tokens), sum(cached_tokens) FROM ledger_entries"
                    )).one()  # fmt: skip
                return row if row[0] >= REQUESTS else None

            row = poll("every request billed", ledger, timeout=120, every=0.5)
            with engine.connect() as conn:
                billed = set(conn.execute(sa.text("SELECT request_id FROM ledger_entries"))
                             .scalars())  # fmt: skip
                bills = conn.execute(sa.text(
                    "SELECT count(*), count(DISTINCT stream_id) FROM events "
                    "WHERE type = 'UsageBilled'"
                )).one()  # fmt: skip
                edges_seen = conn.execute(sa.text(
                    "SELECT count(DISTINCT payload::json->>'edge_id') FROM events "
                    "WHERE type = 'RequestAdmitted'"
                )).scalar()  # fmt: skip
                front_edges = conn.execute(sa.text(
                    "SELECT count(DISTINCT payload::json->>'edge_id') FROM events "
                    "WHERE type = 'RequestAdmitted' AND stream_id = ANY(:ids)"
                ), {"ids": sorted(through_front)}).scalar()  # fmt: skip
        finally:
            engine.dispose()
        assert billed == request_ids
        assert row[0] == row[1] == bills[0] == bills[1] == REQUESTS
        assert edges_seen == 2
        assert len(through_front) == REQUESTS // 3 and front_edges == 2  # a new client, the next
        stats = [httpx.get(f"{url}/sim/stats", timeout=5).json() for url in replicas]
        fleet = [sum(s[k] for s in stats) for k in
                 ("prompt_tokens", "completion_tokens", "cached_tokens", "requests")]  # fmt: skip
        assert [row[2], row[3], row[4], REQUESTS] == fleet
        assert [row[2], row[3], row[4]] == usage

        # A batch through the front address: the cluster's runner feeds its items to edge-1.
        client = OpenAI(base_url=f"{edges[2]}/v1", api_key=keys["demo-standard"], max_retries=0,
                        timeout=30)  # fmt: skip
        items = [{"custom_id": f"b-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                           "max_tokens": 8}} for i in range(3)]  # fmt: skip
        content = b"".join(json.dumps(x).encode() + b"\n" for x in items)
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        done = poll("the batch completed", lambda: (b := client.batches.retrieve(batch.id))
                    .status in ("completed", "failed") and b, timeout=120, every=0.5)  # fmt: skip
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.completed == len(items)

        # A client that leaves mid-stream: the replica says so in one JSON line (its log set up
        # with every other child's format: the replicas' used to set up none).
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "a long story"}],
            max_tokens=4000, stream=True,
        ) as response:
            left = response.headers["x-request-id"]
            next(iter(response.iter_lines()))

        def aborted() -> list[dict[str, Any]]:
            lines = [json.loads(x) for f in (tmp_path / "logs").glob("replica-*.log")
                     for x in f.read_text().splitlines() if x.startswith("{")]  # fmt: skip
            return [x for x in lines if "Aborted request" in x["message"]]

        told = poll("the replica's line", aborted, timeout=30)
        assert len(told) == 1 and told[0]["level"] == "INFO", told
        for name in ("relay", "worker-1", "edge-1"):  # the others log JSON lines too
            assert any(x.startswith("{") for x in
                       (tmp_path / "logs" / f"{name}.log").read_text().splitlines()), name
        assert left

        # Every worker process has its own row: both Kafka workers and the batch runner.
        status = subprocess.run(
            [*TOLLGATE, "status", "--database-url", postgres_url, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        listed = {w["pid"]: w for w in json.loads(status.stdout)["workers"]}
        for name in ("worker-1", "worker-2", "batch-runner"):
            assert pids[name] in listed and not listed[pids[name]]["stale"], status.stdout
        assert listed[pids["batch-runner"]]["name"] == "batch-runner"

        # A child that dies is reported, and the rest keep running.
        os.kill(pids["worker-2"], signal.SIGKILL)
        poll("the dead worker reported",
             lambda: f"worker-2 (pid {pids['worker-2']}) exited with -9" in out.read_text())
        assert proc.poll() is None

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, out.read_text()[-3000:]
        assert [name for name, pid in pids.items() if _alive(pid)] == []
        stopped = out.read_text()
        # The edges too: uvicorn stops serving, then Tollgate's own shutdown runs (it used to
        # re-raise the SIGTERM it caught, exit -15, and the shutdown after it never ran).
        for name in ("batch-runner", "relay", "worker-1", "edge-1", "edge-2"):
            assert f"stopped {name} (exit 0)" in stopped, stopped[-3000:]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql+psycopg://postgres@127.0.0.1:1/test", "PostgreSQL is not reachable at"),
        ("sqlite:///dev-cluster.db", "the dev cluster needs PostgreSQL"),
    ],
)
def test_dev_cluster_without_postgres_says_so_and_starts_nothing(
    url: str, said: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [*TOLLGATE, "dev-cluster", "--database-url", url, "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "TOLLGATE_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("tollgate: error: " + said), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
