"""The batch tier in distributed mode, every part a real process: an edge (`tollgate api`), the
relay, a Kafka worker and `tollgate batch-runner` over one PostgreSQL store and the real
Kafka-protocol broker. Before any runner reports, the edge refuses to create a batch (503
batch_runner_unavailable: nothing would run it); once the runner's heartbeat is there it accepts.
The official SDK drives a batch; the runner is SIGKILLed mid-batch and started again; every item
ends once in the output file and is billed once, at the flex price, with the engine's own
counts, and every other attempt is billed nothing."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from openai import APIStatusError, OpenAI

from tests.e2e.conftest import (
    MODEL,
    TOLLGATE,
    _stop_process,
    free_port,
    poll,
    spawn,
    start_replica,
    wait_http,
)
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
REPLICA = {"speed": 1, "step_base_ms": 15, "scheduling_policy": "priority"}
ITEMS = 30


def test_a_batch_runs_through_the_separate_runner_and_survives_its_kill(
    postgres_url: str, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    env = {
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "TOLLGATE_KAFKA_TOPIC": kafka_topic,
        "TOLLGATE_DATA_DIR": str(tmp_path / "data"),
        "TOLLGATE_BATCH_TOKEN": "batch-token-for-the-test-0123456789",
    }
    replicas = [start_replica(tmp_path, MODEL, seed=41 + i, **REPLICA) for i in range(2)]
    port = free_port()
    edge_url = f"http://127.0.0.1:{port}"
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        proc = spawn([*TOLLGATE, *args, "--database-url", postgres_url],
                     tmp_path / f"{name}.log", env=env)  # fmt: skip
        processes.append(proc)
        return proc

    engine = create_engine_from_url(postgres_url)
    try:
        served = [a for r in replicas for a in ("--replica", f"{r.model}={r.url}")]
        edge = start("edge", "api", "--port", str(port), *served)
        wait_http(f"{edge_url}/healthz", edge, tmp_path / "edge.log", timeout=60)
        start("relay", "relay")
        start("worker", "worker")

        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        client = OpenAI(base_url=f"{edge_url}/v1", api_key=keys["demo-standard"], max_retries=0,
                        timeout=60)  # fmt: skip
        lines = [
            {"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                      "max_tokens": 40, "ignore_eos": True}}
            for i in range(ITEMS)
        ]  # fmt: skip
        content = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id

        def create() -> Any:
            return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h")  # fmt: skip

        with pytest.raises(APIStatusError) as refused:
            create()
        assert refused.value.status_code == 503
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "batch_runner_unavailable", error
        assert "tollgate batch-runner" in error["message"]
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM batches")).scalar() == 0

        runner = start("runner", "batch-runner", "--edge-url", edge_url, "--concurrency", "4")

        def accepted() -> Any:
            try:
                return create()
            except APIStatusError as exc:
                assert exc.status_code == 503, exc
                return None

        batch = poll("the edge accepting a batch once the runner reports", accepted,
                     timeout=60, every=0.5)  # fmt: skip

        def completed() -> int:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts.completed if counts else 0

        poll("a few items completed by the runner", lambda: completed() >= 4, timeout=90,
             every=0.2)  # fmt: skip
        os.kill(runner.pid, signal.SIGKILL)  # items in flight die with it
        runner.wait(10)
        start("runner-2", "batch-runner", "--edge-url", edge_url, "--concurrency", "4")
        done = poll("the batch to complete", lambda: (b := client.batches.retrieve(batch.id))
                    .status == "completed" and b, timeout=180, every=0.5)  # fmt: skip
        assert done.request_counts is not None and done.request_counts.completed == ITEMS
        output: dict[str, list[dict[str, Any]]] = {}
        assert done.output_file_id is not None
        for text in client.files.content(done.output_file_id).text.splitlines():
            if text.strip():
                entry = json.loads(text)
                output.setdefault(entry["custom_id"], []).append(entry)
        assert sorted(output) == sorted(x["custom_id"] for x in lines)
        assert all(len(v) == 1 for v in output.values())

        # Every attempt of every item, from the store; each billed by the Kafka worker.
        with engine.connect() as conn:
            admitted = conn.execute(sa.text(
                "SELECT stream_id, payload FROM events WHERE type = 'RequestAdmitted'"
            )).all()  # fmt: skip
        attempts: dict[str, list[str]] = {}
        for stream_id, payload in admitted:
            item = json.loads(payload).get("batch_item", "")
            if item.startswith(batch.id + "/"):
                attempts.setdefault(item.split("/", 1)[1], []).append(stream_id)
        assert sum(len(v) for v in attempts.values()) >= ITEMS

        def billed() -> dict[str, Any] | None:
            ids = [r for v in attempts.values() for r in v]
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT * FROM ledger_entries WHERE request_id = ANY(:ids)"),
                    {"ids": ids},
                ).mappings().all()  # fmt: skip
            return {r["request_id"]: r for r in rows} if len(rows) == len(ids) else None

        entries = poll("every attempt billed by the worker", billed, timeout=60, every=0.5)
        for custom_id, request_ids in attempts.items():
            rows = [entries[r] for r in request_ids]
            assert {r["service_tier"] for r in rows} == {"flex"}
            charged = [r for r in rows if r["amount_micros"] or r["completion_tokens"]]
            (entry,) = charged  # one bill per item, whatever the kill did to its attempts
            response = output[custom_id][0]["response"]
            assert entry["request_id"] == response["request_id"]
            usage = response["body"]["usage"]
            assert (entry["prompt_tokens"], entry["completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"])  # fmt: skip
            record = next(r.record(entry["request_id"]) for r in replicas
                          if r.record(entry["request_id"]) is not None)  # fmt: skip
            assert record["completion_tokens"] == entry["completion_tokens"]  # the engine's
    finally:
        for proc in processes:
            _stop_process(proc)
        for replica in replicas:
            replica.stop()
        engine.dispose()
