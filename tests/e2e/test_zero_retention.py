"""Issue 30, item 3: the canary test (tests/e2e/test_canary.py) for a zero-retention tenant. Its
one exception there, the response kept for an Idempotency-Key replay, is gone: a retry gets the
status and the request id, not the body. A batch's input is deleted once its items are read
and its output file once it is downloaded. Afterwards neither the canary nor any completion is
in any file of the data dir (the SQLite database, its WAL, checkpointed every second here), any
log, /metrics or any column.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI

from tests.e2e.conftest import FAST, MODEL, auth, poll, running_server
from tests.e2e.test_canary import CANARY, body, columns_containing, completion_text

pytestmark = pytest.mark.e2e


def _holding(paths: list[Path], needle: bytes) -> list[str]:
    return [p.name for p in paths if p.is_file() and needle in p.read_bytes()]


def test_a_zero_retention_tenant_leaves_no_content_anywhere(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_SQLITE_CHECKPOINT_S", "1")
    with running_server(tmp_path_factory, "zero", [(MODEL, FAST)]) as server:
        tenant = server.new_tenant("zero")
        server.cli("retention", "set", "--tenant", tenant.name, "--zero")
        url = f"{server.base}/v1/chat/completions"

        def post(payload: dict[str, Any], **headers: str) -> httpx.Response:
            return httpx.post(
                url, json=payload, headers={**auth(tenant.secret), **headers}, timeout=60
            )

        poll(
            "the server to apply the zero tier",
            lambda: post({"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}).headers.get("x-tollgate-retention")
            == "zero",
        )  # fmt: skip

        plain = post(body())
        streamed = post(body(stream=True, stream_options={"include_usage": True}))
        kept = post(body(max_tokens=41), **{"Idempotency-Key": "zero-replay-1"})
        replayed = post(body(max_tokens=41), **{"Idempotency-Key": "zero-replay-1"})
        kept_stream = post(body(stream=True), **{"Idempotency-Key": "zero-replay-2"})
        replayed_stream = post(body(stream=True), **{"Idempotency-Key": "zero-replay-2"})
        failed = post(body(sim_fail_after_tokens=3))
        answered = (plain, streamed, kept, replayed, kept_stream, replayed_stream)
        assert [r.status_code for r in answered] == [200] * 6
        assert failed.status_code == 502
        for r in (*answered, failed):
            assert r.headers["x-tollgate-retention"] == "zero", r.headers
            assert CANARY not in r.text
        # A retry of a finished request: its status and request id, never its body.
        for first, again in ((kept, replayed), (kept_stream, replayed_stream)):
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["x-request-id"] == first.headers["x-request-id"]
            replay = again.json()
            assert replay["object"] == "tollgate.idempotent_replay"
            assert (replay["request_id"], replay["status"], replay["retention"]) == (
                first.headers["x-request-id"], 200, "zero",
            )  # fmt: skip
        assert completion_text(kept) not in replayed.text

        # A batch: the input is deleted once read, the output file once downloaded.
        client = OpenAI(base_url=f"{server.base}/v1", api_key=tenant.secret)
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
        gone = httpx.get(f"{server.base}/v1/files/{file.id}", headers=auth(tenant.secret))
        assert gone.status_code == 404, "the input is deleted once its items are read"
        output = httpx.get(
            f"{server.base}/v1/files/{done.output_file_id}/content", headers=auth(tenant.secret),
            timeout=30,
        )  # fmt: skip
        assert output.status_code == 200
        again = httpx.get(
            f"{server.base}/v1/files/{done.output_file_id}/content", headers=auth(tenant.secret)
        )
        assert again.status_code == 404, "an output file is downloaded once"
        batch_texts = [
            orjson.loads(row)["response"]["body"]["choices"][0]["message"]["content"]
            for row in output.text.splitlines()
        ]
        assert len(batch_texts) == 3 and all(len(t) >= 20 for t in batch_texts)

        replay_json = json.loads(server.cli("replay", kept.headers["x-request-id"], "--json"))
        assert replay_json["retention"] == "zero"
        server.wait_all_billed()

        texts = [completion_text(plain), completion_text(kept), *batch_texts]
        needles = [CANARY.encode(), *(t.encode() for t in texts)]
        data_dir = server.data_dir
        deadline = time.monotonic() + 30
        left: dict[str, list[str]] = {}
        while time.monotonic() < deadline:  # the WAL is checkpointed (truncated) every second
            files = sorted(p for p in data_dir.rglob("*") if p.is_file())
            left = {n.decode()[:40]: h for n in needles if (h := _holding(files, n))}
            if not left:
                break
            time.sleep(0.5)
        assert left == {}, f"still in {left}"
        metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
        assert CANARY not in metrics

    logs = [server.log, *(r.log for r in server.replicas)]
    for needle in needles:
        assert _holding(logs, needle) == []
        assert columns_containing(server.db_path, needle.decode()) == []
    rows = server.query(
        "SELECT count(*) AS n FROM idempotency_records WHERE tenant_id = ?", (tenant.name,)
    )
    assert rows[0]["n"] == 2, "the replay records stay, without their bodies"
