"""The OpenAI Batch API with the official SDK: files and batches in OpenAI's shapes, items run as
flex requests by the batch runner in the fold worker, each item in its file exactly once and
billed exactly once at the flex price; bad input refused naming the line or field; a cancel
mid-way bills only what completed; a runner killed with SIGKILL resumes without loss,
duplicate or double bill."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, Server, auth, poll, running_server

pytestmark = pytest.mark.e2e

REPLICA = {"speed": 1, "step_base_ms": 15, "scheduling_policy": "priority"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory, "batch", [(MODEL, REPLICA), (MODEL, REPLICA)],
        serve_args=["--batch-window", "30s", "--batch-concurrency", "4"],
    ) as server:
        yield server


def sdk(server: Server, who: str = "demo-standard") -> OpenAI:
    return OpenAI(base_url=f"{server.base}/v1", api_key=server.keys[who], max_retries=0,
                  timeout=60)


def line(custom_id: str, tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {custom_id}"}],
                     "max_tokens": tokens, **body}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def upload(client: OpenAI, content: bytes) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch").id


def wait_status(client: OpenAI, batch_id: str, statuses: set[str], timeout: float = 90) -> Any:
    return poll(f"batch {batch_id} to reach {statuses}",
                lambda: (got := client.batches.retrieve(batch_id)).status in statuses and got,
                timeout=timeout, every=0.3)


def by_custom_id(content: str) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for text in content.splitlines():
        if text.strip():
            entry = json.loads(text)
            found.setdefault(entry["custom_id"], []).append(entry)
    return found


def item_requests(server: Server, batch_id: str) -> dict[str, list[str]]:
    """Every request the edge admitted for the batch's items, by custom id."""
    rows = server.query("SELECT stream_id, payload FROM events WHERE type = 'RequestAdmitted'")
    found: dict[str, list[str]] = {}
    for row in rows:
        item = json.loads(row["payload"]).get("batch_item", "")
        if item.startswith(batch_id + "/"):
            found.setdefault(item.split("/", 1)[1], []).append(row["stream_id"])
    return found


def assert_billed_once(
    server: Server, batch_id: str, output: dict[str, list[dict[str, Any]]]
) -> int:
    """Each completed item is billed once, at the flex price, the engine's counts; every other
    attempt of any item is billed nothing. Returns the attempts that were billed nothing."""
    attempts = item_requests(server, batch_id)
    server.assert_lifecycle([r for ids in attempts.values() for r in ids], timeout=30)
    unbilled = 0
    for custom_id, request_ids in attempts.items():
        charged = []
        for request_id in request_ids:
            entry = server.wait_billed(request_id)
            assert entry["service_tier"] == "flex"
            if entry["amount_micros"] or entry["completion_tokens"]:
                charged.append(entry)
            else:
                unbilled += 1
        if custom_id in output:
            (entry,) = charged  # exactly one bill for a completed item
            response = output[custom_id][0]["response"]
            assert entry["request_id"] == response["request_id"]
            usage = response["body"]["usage"]
            assert (entry["prompt_tokens"], entry["completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"])
            record = next(r.record(entry["request_id"]) for r in server.replicas
                          if r.record(entry["request_id"]) is not None)
            assert record["completion_tokens"] == entry["completion_tokens"]  # the engine's
        else:
            assert charged == [], f"{custom_id} never completed but was billed"
    return unbilled


def test_a_batch_runs_end_to_end_with_the_sdk(fleet: Server) -> None:
    client = sdk(fleet)
    good = [line(f"item-{i}") for i in range(12)]
    bad = line("bad-temperature", temperature=5)  # the endpoint refuses it: the error file
    file = client.files.create(file=("input.jsonl", io.BytesIO(jsonl([*good, bad]))),
                               purpose="batch")
    assert file.object == "file" and file.purpose == "batch" and file.bytes > 0
    assert client.files.retrieve(file.id).id == file.id
    created = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"run": "e2e"})
    assert created.status in ("validating", "in_progress")
    assert created.request_counts is not None and created.request_counts.total == 13
    done = wait_status(client, created.id, {"completed"})
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 1)
    assert done.metadata == {"run": "e2e"}
    assert done.completed_at and done.finalizing_at and done.in_progress_at
    assert done.output_file_id and done.error_file_id
    output = by_custom_id(client.files.content(done.output_file_id).text)
    assert sorted(output) == sorted(x["custom_id"] for x in good)
    assert all(len(v) == 1 for v in output.values())
    for (entry,) in output.values():
        assert entry["response"]["status_code"] == 200
        body = entry["response"]["body"]
        assert body["object"] == "chat.completion" and body["service_tier"] == "flex"
        assert body["model"] == MODEL
    errors = by_custom_id(client.files.content(done.error_file_id).text)
    assert list(errors) == ["bad-temperature"]
    assert errors["bad-temperature"][0]["response"]["status_code"] == 400
    assert errors["bad-temperature"][0]["response"]["body"]["error"]["param"] == "temperature"
    assert assert_billed_once(fleet, created.id, output) == 0
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(created.id)  # a completed batch is not cancellable
    listed = client.batches.list(limit=100)
    assert created.id in [x.id for x in listed.data]
    # Support replays an item by its request id: the batch item is on its admission.
    request_id = output["item-3"][0]["response"]["request_id"]
    admitted = fleet.wait_event(request_id, "RequestAdmitted")
    assert admitted["batch_item"] == f"{created.id}/item-3"
    assert admitted["service_tier"] == "flex"
    # Deleting the input file deletes its content.
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(file.id)


@pytest.mark.parametrize(
    ("content", "where", "param"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
         b"{not json\n", "line 2", "line 2"),
        (jsonl([line("a"), line("b", stream=True)]), "line 2", "line 2: body.stream"),
        (jsonl([line("a"), line("a")]), "line 2", "line 2: custom_id"),
        (jsonl([{**line("a"), "url": "/v1/embeddings"}]), "line 1", "line 1: url"),
        (b"", "no request", "file"),
    ],
)
def test_a_bad_batch_file_is_a_400_naming_its_line(
    fleet: Server, content: bytes, where: str, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        upload(sdk(fleet), content)
    body = err.value.body
    # The param names the line and, when one field is at fault, the field (issue 27 item 2).
    assert isinstance(body, dict) and body["param"] == param
    assert where in body["message"]
    assert "hi a" not in body["message"]  # never the prompt


def test_bad_batch_parameters_are_4xx_naming_the_field(fleet: Server) -> None:
    client = sdk(fleet)
    file_id = upload(client, jsonl([line("a")]))
    cases = [
        ({"endpoint": "/v1/embeddings", "completion_window": "24h"}, 400, "endpoint"),
        ({"endpoint": "/v1/chat/completions", "completion_window": "7d"}, 400,
         "completion_window"),
    ]
    for fields, status, param in cases:
        r = httpx.post(f"{fleet.base}/v1/batches", headers=auth(fleet.keys["demo-standard"]),
                       json={"input_file_id": file_id, **fields}, timeout=10)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    # Another tenant's file is not found (and its content never shown).
    other = sdk(fleet, "demo-enterprise")
    with pytest.raises(openai.NotFoundError) as err:
        other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        other.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(file_id)
    # Over the size bound: refused before it is read whole.
    huge = b"x" * (10 * 1024 * 1024 + 100 * 1024)
    r = httpx.post(f"{fleet.base}/v1/files", headers=auth(fleet.keys["demo-standard"]),
                   files={"file": ("big.jsonl", huge)}, data={"purpose": "batch"}, timeout=30)
    assert r.status_code == 413, r.text
    r = httpx.post(f"{fleet.base}/v1/files", headers=auth(fleet.keys["demo-standard"]),
                   files={"file": ("a.jsonl", jsonl([line("a")]))}, data={"purpose": "tune"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"


def test_a_cancel_mid_way_bills_only_completed_items(fleet: Server) -> None:
    client = sdk(fleet)
    items = [line(f"slow-{i}", tokens=60, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(items)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    poll("some items to complete", lambda: (client.batches.retrieve(batch.id).request_counts
                                           or openai).completed >= 3, timeout=60, every=0.3)
    # The items still to run are the autoscaling signal's deferred demand for their model.
    admin = fleet.cli("keys", "issue", "--tenant", "tollgate-ops", "--scope", "admin")
    admin = admin.strip().splitlines()[-1]

    def deferred() -> int:
        r = httpx.get(f"{fleet.base}/v1/fleet", headers=auth(admin), timeout=10)
        terms = (r.json().get("models", {}).get(MODEL) or {}).get("terms") if r.is_success else {}
        return (terms or {}).get("deferred_tokens", 0)

    poll("deferred batch demand on /v1/fleet", lambda: deferred() > 0, timeout=30, every=0.5)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_status(client, batch.id, {"cancelled"})
    assert done.cancelled_at and done.cancelling_at
    assert done.request_counts is not None and 3 <= done.request_counts.completed < 40
    output = by_custom_id(client.files.content(done.output_file_id).text)
    assert len(output) == done.request_counts.completed
    errors = by_custom_id(client.files.content(done.error_file_id).text)
    assert set(output) | set(errors) == {x["custom_id"] for x in items}
    assert not set(output) & set(errors)
    assert {e[0]["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert_billed_once(fleet, batch.id, output)
    assert client.batches.cancel(batch.id).status == "cancelled"  # a repeat changes nothing


def test_a_short_window_expires_the_rest_and_keeps_what_completed(fleet: Server) -> None:
    client = sdk(fleet)
    items = [line(f"late-{i}", tokens=400, ignore_eos=True) for i in range(60)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(items)),
                                  endpoint="/v1/chat/completions", completion_window="30s")
    done = wait_status(client, batch.id, {"expired"}, timeout=90)
    assert done.expired_at
    counts = done.request_counts
    assert counts is not None and counts.completed < 60
    output = by_custom_id(client.files.content(done.output_file_id).text) \
        if done.output_file_id else {}
    errors = by_custom_id(client.files.content(done.error_file_id).text)
    assert set(output) | set(errors) == {x["custom_id"] for x in items}
    assert {e[0]["error"]["code"] for e in errors.values()} == {"batch_expired"}
    assert_billed_once(fleet, batch.id, output)


def worker_pid(server: Server) -> int:
    rows = server.query(
        "SELECT pid FROM worker_status WHERE name = 'folds' ORDER BY heartbeat_at DESC"
    )
    return int(rows[0]["pid"])


def test_a_runner_killed_mid_batch_resumes_without_loss_duplicate_or_double_bill(
    fleet: Server,
) -> None:
    client = sdk(fleet)
    items = [line(f"kill-{i}", tokens=40, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, jsonl(items)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    poll("items in flight", lambda: (client.batches.retrieve(batch.id).request_counts
                                    or openai).completed >= 4, timeout=60, every=0.2)
    poll("an item running at a replica", lambda: sum(
        r.metric("vllm:num_requests_running") for r in fleet.replicas) > 0, timeout=30, every=0.05)
    killed = worker_pid(fleet)
    killed_at = time.time()  # before: the edge may end a cut attempt within microseconds
    os.kill(killed, signal.SIGKILL)  # the runner dies with items in flight
    poll("the fold worker to be started again",
         lambda: worker_pid(fleet) != killed, timeout=30, every=0.3)
    time.sleep(0.5)
    done = wait_status(client, batch.id, {"completed"}, timeout=120)
    assert done.request_counts is not None and done.request_counts.completed == 40
    output = by_custom_id(client.files.content(done.output_file_id).text)
    assert sorted(output) == sorted(x["custom_id"] for x in items)
    assert all(len(v) == 1 for v in output.values())
    assert_billed_once(fleet, batch.id, output)
    # The kill did land mid-item: some attempt was admitted before it and ended after it (then
    # either the edge saw the runner's connection drop and cancelled it, billed nothing and
    # tried again, or it completed and the restarted runner's retry was its replay).
    attempt_ids = [r for v in item_requests(fleet, batch.id).values() for r in v]
    marks = ",".join("?" * len(attempt_ids))
    spans = fleet.query(
        f"SELECT admitted_at, finished_at FROM request_log WHERE request_id IN ({marks})",
        attempt_ids,
    )

    def epoch(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
    assert any(epoch(r["admitted_at"]) < killed_at < epoch(r["finished_at"]) for r in spans), (
        killed_at, sorted((epoch(r["admitted_at"]), epoch(r["finished_at"])) for r in spans)[:12]
    )
