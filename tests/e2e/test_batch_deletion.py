"""Nothing is kept that was deleted (issue 27, item 5): a batch runs with a canary in its
prompts; once it ends, the runner's own replay records of its items are gone (the customer never
asked for them), and after the customer deletes the input and output files neither the canary
nor a completion is anywhere in the SQLite files — the database (secure_delete), its WAL
(truncated by the periodic checkpoint, 1 s here, 60 s by default) or its shared memory."""

from __future__ import annotations

import io
import json
import sqlite3
import time
import uuid
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e.conftest import FAST, MODEL, poll, running_server

pytestmark = pytest.mark.e2e

CANARY = f"canary-{uuid.uuid4().hex}"


def _holding(data_dir: Path, needle: bytes) -> list[str]:
    return [p.name for p in sorted(data_dir.glob("tollgate.db*")) if needle in p.read_bytes()]


def test_a_deleted_batch_leaves_no_content_in_the_files(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_SQLITE_CHECKPOINT_S", "1")
    with running_server(tmp_path_factory, "deletion", [(MODEL, FAST)]) as server:
        client = OpenAI(base_url=f"{server.base}/v1", api_key=server.keys["demo-standard"])
        lines = [
            {"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 24, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"say {CANARY} {i}"}]}}
            for i in range(3)
        ]  # fmt: skip
        content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        poll("the batch to complete",
             lambda: client.batches.retrieve(batch.id).status == "completed",
             timeout=90, every=0.5)  # fmt: skip
        done = client.batches.retrieve(batch.id)
        assert done.output_file_id is not None
        output = client.files.content(done.output_file_id).text
        completions = [
            json.loads(row)["response"]["body"]["choices"][0]["message"]["content"]
            for row in output.splitlines()
        ]
        assert all(len(text) >= 20 for text in completions), completions
        needles = [CANARY.encode(), *(text.encode() for text in completions)]
        # The runner's replay records went when the batch ended.
        db = sqlite3.connect(f"file:{server.db_path}?mode=ro", uri=True, timeout=30)
        try:
            kept = db.execute(
                "SELECT count(*) FROM idempotency_records WHERE idempotency_key LIKE 'batch-%'"
            ).fetchone()[0]
        finally:
            db.close()
        assert kept == 0

        # Deleted: what was derived from them and the bytes of both.
        assert client.files.delete(file.id).deleted
        assert client.files.delete(done.output_file_id).deleted
        data_dir = server.data_dir
        deadline = time.monotonic() + 30
        left: dict[str, list[str]] = {}
        while time.monotonic() < deadline:
            left = {n.decode()[:40]: h for n in needles if (h := _holding(data_dir, n))}
            if not left:
                break
            time.sleep(0.5)
        assert left == {}, f"still in {left}"
