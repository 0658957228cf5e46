"""The official openai SDK against `tollgate serve`: what the client sees is what the engine
recorded and what the ledger bills, to the token."""

from __future__ import annotations

import http.client
import json
import subprocess
import time

import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, RATE_LIMIT_HEADERS, SLOW_MODEL, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base}/v1", api_key=server.keys["demo-standard"],
                  max_retries=0, timeout=30)


def assert_three_way(server: Server, request_id: str, prompt: int, completion: int,
                     cached: int) -> None:
    """Client usage == ledger entry == the simulator's own record of that request."""
    entry = server.wait_billed(request_id)
    assert (entry["prompt_tokens"], entry["completion_tokens"], entry["cached_tokens"]) == (
        prompt, completion, cached,
    ), f"ledger {dict(entry)} differs from the client's usage"
    routed = [p for t, p in server.events(request_id) if t == "RequestRouted"]
    assert len(routed) == 1
    record = server.replica(routed[0]["replica_id"]).record(request_id)
    assert record is not None, "the replica has no record of the request it was routed"
    assert record["finished"]
    assert (record["prompt_tokens"], record["completion_tokens"], record["cached_tokens"]) == (
        prompt, completion, cached,
    ), f"simulator record {record} differs from the client's usage"
    assert entry["tenant_id"] == "demo-standard"
    assert entry["amount_micros"] >= 0


def test_non_streaming_usage_matches_ledger_and_engine(server: Server, client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something short."}],
        max_tokens=24,
    )
    request_id = raw.headers["x-request-id"]
    assert request_id.startswith("req_")
    for name in RATE_LIMIT_HEADERS:
        assert name in raw.headers, f"missing {name}"
    assert int(raw.headers["x-ratelimit-limit-requests"]) == 600  # standard plan
    assert 0 <= int(raw.headers["x-ratelimit-remaining-requests"]) < 600
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    usage = completion.usage
    assert usage is not None and 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    assert_three_way(server, request_id, usage.prompt_tokens, usage.completion_tokens, cached)
    assert server.event_types(request_id)[-3:] == [
        "RequestCompleted", "QuotaRefunded", "UsageBilled"
    ]


def test_streaming_usage_matches_ledger_and_engine(server: Server, client: OpenAI) -> None:
    # A long shared prefix sent twice: the second request hits the tenant's prefix cache, so
    # cached tokens are billed (and checked) too.
    system = " ".join(["You are a careful assistant who answers briefly."] * 12)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    seen = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True,
            stream_options={"include_usage": True},
        )
        request_id = raw.headers["x-request-id"]
        for name in RATE_LIMIT_HEADERS:
            assert name in raw.headers, f"missing {name} on a stream"
        assert raw.headers["content-type"].startswith("text/event-stream")
        text, usage = [], None
        for chunk in raw.parse():
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                assert chunk.usage is None  # only the final chunk carries usage
            else:
                usage = chunk.usage
        assert usage is not None, "include_usage asked for a final usage chunk"
        assert "".join(text)
        assert 1 <= usage.completion_tokens <= 16
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        assert_three_way(server, request_id, usage.prompt_tokens, usage.completion_tokens, cached)
        seen.append(cached)
    # Two replicas: the second request may land on the other one (cold cache). When it lands on
    # the same one it must report the cache hit; either way the three counts agreed above.
    assert seen[0] == 0


def test_models_list_and_base_name_resolution(server: Server, client: OpenAI) -> None:
    ids = sorted(m.id for m in client.models.list())
    assert ids == sorted({MODEL, SLOW_MODEL})
    raw = client.chat.completions.with_raw_response.create(
        model="llama-3.1-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
    )
    completion = raw.parse()
    assert completion.model == MODEL  # the base name resolved to its (newest) version
    request_id = raw.headers["x-request-id"]
    admitted = [p for t, p in server.events(request_id) if t == "RequestAdmitted"]
    assert admitted[0]["model"] == MODEL
    assert server.wait_billed(request_id)["model"] == MODEL


def test_curl_streaming_ends_with_done(server: Server) -> None:
    body = json.dumps({
        "model": MODEL, "stream": True, "max_tokens": 12,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hello from curl"}],
    })
    done = subprocess.run(
        ["curl", "-sS", "-N", "-D", "-", f"{server.base}/v1/chat/completions",
         "-H", f"Authorization: Bearer {server.keys['demo-standard']}",
         "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    # text mode turns the header lines' CRLF into LF: the head ends at the first blank line
    head, _, stream = done.stdout.partition("\n\n")
    assert head.startswith("HTTP/1.1 200")
    request_id = next(
        line.split(":", 1)[1].strip() for line in head.splitlines()
        if line.lower().startswith("x-request-id:")
    )
    frames = [f for f in stream.split("\n\n") if f.strip()]
    assert frames[-1] == "data: [DONE]"
    assert stream.endswith("data: [DONE]\n\n")
    assert all(f.startswith("data: ") for f in frames)
    usage = json.loads(frames[-2][6:])["usage"]
    entry = server.wait_billed(request_id)
    assert entry["completion_tokens"] == usage["completion_tokens"]
    assert entry["prompt_tokens"] == usage["prompt_tokens"]


def test_a_connection_idle_past_the_clients_keep_alive_expiry_is_still_open(
    server: Server,
) -> None:
    """httpx (and so the openai SDK) reuses an idle connection for up to 5 s. An edge that closes
    idle connections at 5 s too races it: the client sends on a connection being closed and gets
    a ReadError. The edge keeps them open well past every usual client's expiry."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {"Authorization": f"Bearer {server.keys['demo-standard']}"}
    try:
        conn.request("GET", "/v1/models", headers=headers)
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        sock = conn.sock
        time.sleep(6.0)  # past httpx's 5 s (and uvicorn's default keep-alive)
        conn.request("GET", "/v1/models", headers=headers)
        again = conn.getresponse()  # RemoteDisconnected if the edge closed it
        again.read()
        assert again.status == 200
        assert conn.sock is sock, "the second request went over a new connection"
    finally:
        conn.close()
