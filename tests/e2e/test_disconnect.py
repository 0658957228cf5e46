"""A client that leaves mid-stream: the edge cancels at the replica at once (KV freed), refunds,
and bills exactly the tokens the engine sent — the simulator's record is the ground truth."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import pytest

from tests.e2e.conftest import MODEL, SLOW_MODEL, Server, auth, long_body, poll, short_body

pytestmark = pytest.mark.e2e

# Tokens the engine may write between the edge's last read and its abort (one frame; a frame of
# the fast replica can carry a few tokens when the edge falls behind).


def stream_then_leave(server: Server, secret: str, model: str, frames_to_read: int) -> str:
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", f"{server.base}/v1/chat/completions", headers=auth(secret),
        json=long_body(model, 3000, stream=True),
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        content = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    content += 1
                    if content >= frames_to_read:
                        break
        assert content >= frames_to_read
    # leaving the `with` closes the connection with the body unread: the client is gone
    return request_id


@pytest.mark.parametrize(
    "model,frames",
    [(SLOW_MODEL, n) for n in (1, 3, 5, 8, 13)] + [(MODEL, n) for n in (1, 2, 4, 8, 16)],
)
def test_disconnect_bills_exactly_what_the_engine_sent(
    server: Server, model: str, frames: int
) -> None:
    secret = server.keys["demo-enterprise"]
    request_id = stream_then_leave(server, secret, model, frames)
    entry = server.wait_billed(request_id)
    types = server.event_types(request_id)
    assert "RequestCancelled" in types, types
    assert "RequestCompleted" not in types and "RequestFailed" not in types, types
    assert types.count("QuotaRefunded") == 1 and types.count("UsageBilled") == 1, types
    assert entry["terminal"] == "cancelled"

    routed = next(p for t, p in server.events(request_id) if t == "RequestRouted")
    replica = server.replica(routed["replica_id"])
    record = poll(
        f"the replica to finish {request_id}",
        lambda: (rec := replica.record(request_id)) and rec["finished"] and rec,
        timeout=10,
    )
    assert record["finish_reason"] == "abort"
    cancelled = next(p for t, p in server.events(request_id) if t == "RequestCancelled")
    assert cancelled["engine_reported"] is True
    assert (entry["prompt_tokens"], entry["cached_tokens"]) == (
        record["prompt_tokens"], record["cached_tokens"],
    ), f"billed {dict(entry)} but the engine sent {record}"
    # Completion tokens: exact. The edge aborts by half-closing the engine connection and
    # reads what the engine had already sent before dropping it (engine_adapter.vllm_http), so
    # every token the engine produced is billed — not only those the client read.
    assert entry["completion_tokens"] == record["completion_tokens"], (
        f"billed {entry['completion_tokens']} completion tokens, the engine sent "
        f"{record['completion_tokens']} ({record})"
    )
    assert entry["completion_tokens"] >= frames
    assert record["completion_tokens"] < 3000, "generation was not cut short"
    # The KV came back: nothing runs on the replica any more.
    poll(
        "vllm:num_requests_running to return to 0",
        lambda: replica.metric("vllm:num_requests_running") == 0,
        timeout=10,
    )


def test_a_client_gone_while_its_admission_commits_is_cancelled_not_left_to_expire(
    server: Server,
) -> None:
    """The admission's commit goes on when the client leaves during it. If it commits, the
    request is admitted: the edge must end it at once (cancelled, quota refunded), not leave it
    to the lease sweeper 15 s later. The commit is held back by holding SQLite's write lock."""
    tenant = server.new_tenant("gone-while-admitted")
    lock = sqlite3.connect(server.db_path, timeout=10, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # every append now waits for this connection
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.5) as client:
            client.post(
                f"{server.base}/v1/chat/completions", headers=auth(tenant.secret),
                json=short_body(),
            )
        time.sleep(0.3)  # the edge has seen the disconnect while its commit waits
    finally:
        lock.execute("ROLLBACK")
        lock.close()

    def admitted() -> list[str]:
        rows = server.query(
            "SELECT stream_id FROM events WHERE type = 'RequestAdmitted' AND tenant_id = ?",
            (tenant.name,),
        )
        return [r["stream_id"] for r in rows]

    (request_id,) = poll("the admission to commit", admitted, timeout=10)
    cancelled = server.wait_event(request_id, "RequestCancelled", timeout=5)
    assert cancelled["reason"] == "client_disconnected"
    types = server.event_types(request_id)
    assert "LeaseExpired" not in types and types.count("QuotaRefunded") == 1, types
    assert server.wait_billed(request_id)["completion_tokens"] == 0


def test_clients_gone_mid_stream_leave_no_traceback_in_any_log(server: Server) -> None:
    """A client that leaves is expected: neither the edge nor the replica it was streaming from
    logs an error about it. The replica wrote tracebacks ("Error handling request") when a
    write found the connection closing before the disconnect cancelled its handler."""
    logs = [server.log, *(r.log for r in server.replicas)]
    before = {log: log.stat().st_size for log in logs}
    secret = server.keys["demo-enterprise"]
    for model, frames in [(MODEL, n) for n in (1, 2, 3, 5, 8, 13)] + [(SLOW_MODEL, 2)]:
        request_id = stream_then_leave(server, secret, model, frames)
        assert server.wait_billed(request_id)["terminal"] == "cancelled"
    for log in logs:
        with open(log, "rb") as f:
            f.seek(before[log])
            written = f.read().decode(errors="replace")
        assert "Traceback" not in written and "Error handling request" not in written, (
            f"{log.name}:\n{written[-3000:]}"
        )
