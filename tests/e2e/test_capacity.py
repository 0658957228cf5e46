"""429 is the tenant's quota, 503 is our capacity: never mixed (DESIGN §4.7).

Its own server: one replica with a tiny KV cache (64 blocks of 16 = 1,024 tokens) and slow steps,
so one long enterprise request holds the KV above the free tier's 0.60 ceiling and, even when
it has generated every token, below standard's 0.85 — the test does not race the generation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server, auth, poll, running_server, short_body

pytestmark = pytest.mark.e2e

QUOTA_TYPES = {"requests", "tokens", "concurrency"}


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = {"num_gpu_blocks": 64, "max_model_len": 1024, "step_base_ms": 150, "speed": 1}
    with running_server(tmp_path_factory, "capacity", [(MODEL, config)]) as server:
        yield server


def post(server: Server, who: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/chat/completions", headers=auth(server.keys[who]),
                      json=body, timeout=30)


def assert_never_mixed(r: httpx.Response) -> None:
    if r.status_code == 429:
        assert r.json()["error"]["type"] in QUOTA_TYPES, r.text
    elif r.status_code == 503:
        assert r.json()["error"]["type"] == "capacity", r.text


def test_capacity_refusal_is_503_and_quota_refusal_is_429(small_fleet: Server) -> None:
    server = small_fleet
    replica = server.replicas[0]
    # ~660 prompt tokens = 42 of 64 blocks (0.66) at the start, ~810 tokens = 51 blocks (0.80)
    # at the end: over free's 0.60 and under standard's 0.85 for the whole ~22 s it runs.
    big_prompt = " ".join(["abc"] * 650)
    body = {"model": MODEL, "messages": [{"role": "user", "content": big_prompt}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", f"{server.base}/v1/chat/completions",
        headers=auth(server.keys["demo-enterprise"]), json=body,
    ) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        next(lines)
        poll("the replica's KV to pass 0.60",
             lambda: replica.metric("vllm:kv_cache_usage_perc") > 0.6, timeout=10)

        def free_is_refused() -> httpx.Response | None:
            r = post(server, "demo-free", short_body(tokens=4))
            assert r.status_code in (200, 503), r.text  # before the scrape it may still pass
            return r if r.status_code == 503 else None

        # The router sees the occupancy at its next scrape (every 250 ms).
        r = poll("a free-tier capacity refusal", free_is_refused, timeout=10, every=0.3)
        error = r.json()["error"]
        assert error["type"] == "capacity" and error["code"] == "server_overloaded"
        assert 5 <= int(r.headers["retry-after"]) <= 10
        assert_never_mixed(r)
        rejected = server.wait_event(r.headers["x-request-id"], "RequestRejected")
        assert rejected["reason"] == "capacity"
        # The free tenant's quota was not charged for the refusal: still 20/min minus nothing
        # more than what passed before the scrape.
        assert int(r.headers["x-ratelimit-remaining-requests"]) >= 17

        # The enterprise tenant is within its quota and below its 0.92 ceiling: admitted.
        ok = post(server, "demo-enterprise", short_body(tokens=4))
        assert ok.status_code == 200, ok.text
        # Standard's ceiling is 0.85: admitted too.
        assert post(server, "demo-standard", short_body(tokens=4)).status_code == 200
        long_id = stream.headers["x-request-id"]
    server.wait_billed(long_id)
    poll("the KV to be freed", lambda: replica.metric("vllm:num_requests_running") == 0)

    # Capacity is back: flooding the free tenant now ends in 429 (its quota), never 503.
    statuses = []
    for _ in range(25):
        r = post(server, "demo-free", short_body(tokens=1))
        assert_never_mixed(r)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "requests"
            assert int(r.headers["retry-after"]) >= 5
            break
    assert statuses[-1] == 429, statuses
    assert set(statuses) <= {200, 429}, statuses
    server.assert_lifecycle()
