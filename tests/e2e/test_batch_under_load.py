"""A batch (500 items in the long tier, 150 in the fast one) on a small simulated fleet while
interactive traffic ramps up: the batch harvests idle capacity and is preempted when interactive
work needs the room. Reported (not asserted as a time): interactive TTFT p95 alone and with the
batch running, measured in this run.
Asserted: every item ends exactly once in the output or error file, billed tokens equal the
engine's counts for every completed item, and preempted attempts are billed nothing."""

from __future__ import annotations

import io
import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, Server, auth, running_server
from tests.e2e.test_batch import assert_billed_once, by_custom_id, item_requests, wait_status
from tests.faults.tier import pick

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Two replicas of 160 blocks (2,560 tokens of KV): a handful of requests fill one.
REPLICA = {"speed": 2, "step_base_ms": 10, "num_gpu_blocks": 160, "max_model_len": 2048,
           "scheduling_policy": "priority"}
RAMP = (1, 2, 4, 6)  # interactive clients, one step each
STEP_S = pick(4, 6)  # seconds a step
ITEMS = pick(150, 500)  # the 500 in the long tier (./dev reliability)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory, "batch-load", [(MODEL, REPLICA), (MODEL, REPLICA)],
        serve_args=["--batch-concurrency", "8"],
    ) as server:
        yield server


def ramp(server: Server, secret: str) -> tuple[list[float], list[str]]:
    """Interactive streams at rising concurrency: every first-token time seen by the client, in
    seconds, and the request ids."""
    ttfts: list[float] = []
    ids: list[str] = []
    lock = threading.Lock()
    prompt = " ".join(["word"] * 300)

    def client(until: float) -> None:
        with httpx.Client(base_url=server.base, timeout=60) as http:
            while time.monotonic() < until:
                started = time.monotonic()
                with http.stream("POST", "/v1/chat/completions", headers=auth(secret), json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 40, "ignore_eos": True, "stream": True,
                }) as r:
                    if r.status_code != 200:
                        r.read()
                        time.sleep(0.2)
                        continue
                    lines = r.iter_lines()
                    next(lines)
                    with lock:
                        ttfts.append(time.monotonic() - started)
                        ids.append(r.headers["x-request-id"])
                    for _ in lines:
                        pass

    for clients in RAMP:
        until = time.monotonic() + STEP_S
        threads = [threading.Thread(target=client, args=(until,)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return ttfts, ids


def engine_ttfts(server: Server, ids: list[str]) -> list[float]:
    """The same requests' time to first token inside the engine (arrival to first token, from
    the simulated replica's own record): the scheduling policy's share, without the gateway's
    and the client's."""
    found = []
    for rid in ids:
        for replica in server.replicas:
            record = replica.record(rid)
            if record is not None and record["first_token_s"] is not None:
                found.append(record["first_token_s"] - record["arrival_s"])
                break
    return found


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 20 else max(values)


def test_a_batch_under_ramping_interactive_traffic(fleet: Server) -> None:
    interactive = fleet.new_tenant("interactive", plan="free", rpm=100_000, tpm=100_000_000)
    alone, alone_ids = ramp(fleet, interactive.secret)

    client = OpenAI(base_url=f"{fleet.base}/v1", api_key=fleet.keys["demo-standard"],
                    max_retries=0, timeout=60)
    items = [{"custom_id": f"load-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 60, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"item {i} " + "x " * 80}]}}
             for i in range(ITEMS)]
    content = b"".join(json.dumps(x).encode() + b"\n" for x in items)
    file = client.files.create(file=("load.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    time.sleep(2.0)  # the batch has filled the idle capacity
    with_batch, with_batch_ids = ramp(fleet, interactive.secret)
    done = wait_status(client, batch.id, {"completed"}, timeout=900)

    output = by_custom_id(client.files.content(done.output_file_id).text)
    errors = by_custom_id(client.files.content(done.error_file_id).text) \
        if done.error_file_id else {}
    assert set(output) | set(errors) == {x["custom_id"] for x in items}
    assert not set(output) & set(errors)
    assert all(len(v) == 1 for v in output.values())
    assert done.request_counts is not None and done.request_counts.completed == len(output)
    unbilled = assert_billed_once(fleet, batch.id, output)
    attempts = sum(len(v) for v in item_requests(fleet, batch.id).values())
    preempted = fleet.query(
        "SELECT count(*) AS n FROM request_log WHERE status = 'preempted'")[0]["n"]
    billed_preempted = fleet.query(
        "SELECT count(*) AS n FROM ledger_entries WHERE terminal = 'preempted' "
        "AND (amount_micros > 0 OR completion_tokens > 0)")[0]["n"]
    assert billed_preempted == 0
    report = {
        "interactive_ttft_p95_alone_s": round(p95(alone), 4),
        "interactive_ttft_p95_with_batch_s": round(p95(with_batch), 4),
        "engine_ttft_p95_alone_s": round(p95(engine_ttfts(fleet, alone_ids)), 4),
        "engine_ttft_p95_with_batch_s": round(p95(engine_ttfts(fleet, with_batch_ids)), 4),
        "interactive_requests_alone": len(alone),
        "interactive_requests_with_batch": len(with_batch),
        "batch_items": len(items), "completed": len(output), "failed": len(errors),
        "attempts": attempts, "attempts_billed_nothing": unbilled, "preempted": preempted,
    }
    print("batch under load:", json.dumps(report))
    ratio = report["interactive_ttft_p95_with_batch_s"] / max(1e-9, report[
        "interactive_ttft_p95_alone_s"])
    print(f"interactive TTFT p95 with the batch / alone: {ratio:.2f}")
    assert len(alone) > 20 and len(with_batch) > 20  # both ramps measured something
