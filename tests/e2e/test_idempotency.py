"""Idempotency-Key: a replay never generates or bills twice; a different body is 422; a key still
in flight is 409; a cancelled request frees its key."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import SLOW_MODEL, Server, auth, long_body, short_body

pytestmark = pytest.mark.e2e


def headers(server: Server, key: str) -> dict[str, str]:
    return {**auth(server.keys["demo-standard"]), "Idempotency-Key": key}


def admissions_with_key(server: Server, key: str) -> list[str]:
    rows = server.query(
        "SELECT stream_id FROM events WHERE type = 'RequestAdmitted' "
        "AND json_extract(payload, '$.idempotency_key') = ?", (key,),
    )
    return [r["stream_id"] for r in rows]


def assert_one_generation(server: Server, key: str, request_id: str) -> None:
    assert admissions_with_key(server, key) == [request_id]
    server.wait_billed(request_id)
    types = server.event_types(request_id)
    assert types.count("RequestAdmitted") == 1 and types.count("UsageBilled") == 1, types


def test_same_key_same_body_replays_without_a_second_bill(server: Server) -> None:
    key = f"idem-{uuid.uuid4()}"
    body = short_body(tokens=12)
    url = f"{server.base}/v1/chat/completions"
    first = httpx.post(url, headers=headers(server, key), json=body, timeout=30)
    second = httpx.post(url, headers=headers(server, key), json=body, timeout=30)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert second.content == first.content
    assert second.headers["x-request-id"] == first.headers["x-request-id"]
    assert second.headers.get("idempotent-replayed") == "true"
    assert "idempotent-replayed" not in first.headers
    assert_one_generation(server, key, first.headers["x-request-id"])

    # Same key, different body: an error, not a replay and not a new generation.
    other = httpx.post(url, headers=headers(server, key), json=short_body(tokens=13), timeout=30)
    assert other.status_code == 422, other.text
    error = other.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
    assert_one_generation(server, key, first.headers["x-request-id"])


def test_streaming_replay(server: Server) -> None:
    key = f"idem-{uuid.uuid4()}"
    body = short_body(tokens=10, stream=True, stream_options={"include_usage": True})
    url = f"{server.base}/v1/chat/completions"
    first = httpx.post(url, headers=headers(server, key), json=body, timeout=30)
    second = httpx.post(url, headers=headers(server, key), json=body, timeout=30)
    assert first.status_code == second.status_code == 200
    assert first.text.endswith("data: [DONE]\n\n")
    assert second.content == first.content
    assert second.headers["x-request-id"] == first.headers["x-request-id"]
    assert second.headers["idempotent-replayed"] == "true"
    assert second.headers["content-type"].startswith("text/event-stream")
    assert_one_generation(server, key, first.headers["x-request-id"])


def test_key_in_flight_is_409_and_a_cancelled_request_frees_it(server: Server) -> None:
    key = f"idem-{uuid.uuid4()}"
    body = long_body(SLOW_MODEL, 1500, stream=True)
    url = f"{server.base}/v1/chat/completions"
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", url, headers=headers(server, key), json=body
    ) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        first_id = stream.headers["x-request-id"]
        again = httpx.post(url, headers=headers(server, key), json=body, timeout=30)
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "idempotency_key_in_flight"
        different = httpx.post(url, headers=headers(server, key), json=short_body(), timeout=30)
        assert different.status_code == 422, different.text
    # The client left: the request is cancelled and billed once, and the key is free again.
    entry = server.wait_billed(first_id)
    assert entry["terminal"] == "cancelled"
    assert admissions_with_key(server, key) == [first_id]
    for _ in range(50):  # the key is released right after the cancellation is recorded
        retry = httpx.post(url, headers=headers(server, key), json=body | {"max_tokens": 5},
                           timeout=30)
        if retry.status_code != 409:
            break
        time.sleep(0.2)
    # A different body under a freed key is a new request, not a 422: nothing was kept for it.
    assert retry.status_code == 200, retry.text
    frames = [f for f in retry.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[1][6:])["choices"]
    assert len(admissions_with_key(server, key)) == 2
    server.assert_lifecycle(admissions_with_key(server, key))
