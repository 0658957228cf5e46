"""A client that stops reading mid-stream (issue 14, hole 4): its buffer is bounded, and once it
has read nothing for the slow-reader timeout with that buffer full, the edge cancels the
generation at the engine, bills what the engine produced, and says so — in the stream, when the
client reads again, and in the replay. With the safeguard off (`--slow-reader-timeout 0`) the
same client keeps the engine generating to the end: the test must see that failure.

The client is httpx with a 32 KiB receive buffer and the edge gives client connections a 64 KiB
send buffer (so the kernels do not hide megabytes of
unread stream behind their autotuning on loopback); it reads a few frames, then nothing.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, TERMINALS, Server, auth, poll, running_server
from tests.faults.tier import safeguards

pytestmark = pytest.mark.e2e

SLOW_READER_S = 2.0
MAX_TOKENS = 8000
READ_FIRST = 5  # content frames read before the client stops reading


def _fleet(factory: pytest.TempPathFactory, timeout_s: float, name: str) -> Iterator[Server]:
    with running_server(
        factory,
        name,
        [(MODEL, FAST)],
        [
            "--slow-reader-timeout",
            str(timeout_s),
            "--stream-buffer-chunks",
            "32",
            "--client-send-buffer",
            "65536",
        ],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _fleet(tmp_path_factory, SLOW_READER_S, "slow-reader-on")


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The safeguard off: no slow reader is ever cancelled."""
    yield from _fleet(tmp_path_factory, 0, "slow-reader-off")


def _slow_client() -> httpx.Client:
    transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)])
    return httpx.Client(transport=transport, timeout=60)


BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write without end."}],
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "stream": True,
}


def _content(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line[6:])
    return bool(chunk.get("choices") and chunk["choices"][0]["delta"].get("content"))


@pytest.mark.parametrize("safeguard", safeguards("on", "off"))
def test_a_client_that_stops_reading_is_cancelled_and_billed_what_the_engine_made(
    safeguard: str, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue("guarded" if safeguard == "on" else "unguarded")
    tenant = server.new_tenant("slow-reader", "enterprise", max_output=MAX_TOKENS)
    seen = 0
    tail: list[str] = []
    with (
        _slow_client() as client,
        client.stream(
            "POST",
            f"{server.base}/v1/chat/completions",
            headers=auth(tenant.secret),
            json=BODY,
        ) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        for line in lines:
            seen += _content(line)
            if seen >= READ_FIRST:
                break
        # The client reads nothing now, until the engine has stopped (either way), then reads
        # again: the rest of its buffer, then an error object and [DONE] or the whole answer.
        routed = next(p for t, p in server.events(request_id) if t == "RequestRouted")
        replica = server.replica(routed["replica_id"])
        record = poll(
            "the engine to stop",
            lambda: (r := replica.record(request_id)) and r["finished"] and r,
            timeout=60,
            every=0.25,
        )
        tail = [line for line in lines if line]
    terminal = poll("the request to end", lambda: _terminal(server, request_id))
    entry = server.wait_billed(request_id)
    violations: list[str] = []
    kind, payload = terminal
    if (kind, payload.get("reason")) != ("RequestCancelled", "slow_reader"):
        violations.append(f"ended {kind} ({payload.get('reason')}), not cancelled as a slow reader")
    if record["finish_reason"] != "abort" or record["completion_tokens"] >= MAX_TOKENS:
        violations.append(
            f"the engine generated {record['completion_tokens']} of {MAX_TOKENS} tokens "
            f"({record['finish_reason']}) for a client that read {seen} frames"
        )
    if entry["completion_tokens"] != record["completion_tokens"]:
        violations.append(
            f"billed {entry['completion_tokens']}, engine produced {record['completion_tokens']}"
        )
    print(
        f"slow reader (safeguard {safeguard}): operations 1 / faults injected 1 (client stops "
        f"reading after {seen} frames) / lost 0 / duplicated 0 / invariant violations "
        f"{len(violations)}; engine produced {record['completion_tokens']}, billed "
        f"{entry['completion_tokens']}"
    )
    if safeguard == "off":
        assert violations, "with the safeguard off the slow reader must keep the engine busy"
        return
    assert not violations, violations
    assert payload["engine_reported"] is True
    errors = [json.loads(x[6:]) for x in tail if x.startswith('data: {"error"')]
    assert [e["error"]["code"] for e in errors] == ["slow_reader"], tail[-3:]
    assert "read nothing" in errors[0]["error"]["message"]
    assert tail[-1] == "data: [DONE]", tail[-3:]
    timeline = httpx.get(
        f"{server.base}/v1/requests/{request_id}/events", headers=auth(tenant.secret), timeout=10
    ).json()
    notes = [e.get("note", "") for e in timeline["events"] if e["type"] == "RequestCancelled"]
    assert notes and "slow-reader timeout" in notes[0], timeline["events"]
    poll(
        "the replica to run nothing",
        lambda: replica.metric("vllm:num_requests_running") == 0,
        timeout=10,
    )


def test_a_slow_reader_that_never_reads_again_is_dropped(guarded: Server) -> None:
    """Cancelled, and still silent a timeout later: its connection is dropped, so a client that
    never comes back holds neither the engine nor the edge's buffers."""
    server = guarded
    tenant = server.new_tenant("slow-reader-gone", "enterprise", max_output=MAX_TOKENS)
    before = _metric(server, "tollgate_slow_readers_dropped_total")
    lines: list[str] = []
    with (
        _slow_client() as client,
        client.stream(
            "POST",
            f"{server.base}/v1/chat/completions",
            headers=auth(tenant.secret),
            json=BODY,
        ) as response,
    ):
        request_id = response.headers["x-request-id"]
        stream = response.iter_lines()
        next(stream)
        poll(
            "the edge to drop the connection",
            lambda: _metric(server, "tollgate_slow_readers_dropped_total") > before,
            timeout=60,
            every=0.25,
        )
        with pytest.raises(httpx.HTTPError):  # what was still buffered, then the reset
            lines.extend(stream)
    assert "data: [DONE]" not in lines
    assert server.wait_event(request_id, "RequestCancelled")["reason"] == "slow_reader"
    server.assert_lifecycle([request_id])


def _terminal(server: Server, request_id: str) -> tuple[str, dict[str, object]] | None:
    return next(((t, p) for t, p in server.events(request_id) if t in TERMINALS), None)


def _metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
