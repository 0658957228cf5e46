"""The slow-reader guard works with the default settings (issue 27, item 4): streaming clients
that send their request and then read nothing at all are cancelled at the engine once their
buffers fill, and each is billed exactly what the engine generated. Before, the kernel
autotuned each connection's send buffer to megabytes, the edge's own buffer never filled, and
the engine generated every token for every silent client."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import FAST, MODEL, Server, poll, running_server

pytestmark = pytest.mark.e2e

CLIENTS = 12
# ~2.4 MB of chunks with their usage: more than every default buffer on the way, and room for
# the guard (the buffers fill after ~700 tokens, then 2 s of nothing read, at the fast
# replica's ~1,000 tokens a second; 3,000 left too little margin on a loaded machine: once the
# engine had generated them all before the cancel)
MAX_TOKENS = 8000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Only the timeout is shortened: buffers and send buffer are the defaults.
    with running_server(
        tmp_path_factory, "silent", [(MODEL, FAST)], ["--slow-reader-timeout", "2"]
    ) as s:
        yield s


def _silent_client(server: Server, key: str) -> socket.socket:
    body = json.dumps({
        "model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write without end."}],
    }).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: tollgate\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock  # and never read from


def test_silent_streaming_clients_are_cancelled_and_billed_the_engines_count(
    server: Server,
) -> None:
    key = server.keys["demo-enterprise"]
    sockets = [_silent_client(server, key) for _ in range(CLIENTS)]
    try:
        def decided(kind: str) -> list[str]:
            rows = server.query("SELECT stream_id FROM events WHERE type = ?", (kind,))
            return [r["stream_id"] for r in rows]

        poll("every silent client admitted or refused",
             lambda: len(decided("RequestAdmitted")) + len(decided("RequestRejected")) == CLIENTS,
             timeout=30)  # fmt: skip
        ids = decided("RequestAdmitted")
        assert len(ids) >= CLIENTS // 2, f"only {len(ids)} of {CLIENTS} admitted"
        server.assert_lifecycle(ids, timeout=90)
        replica = server.replicas[0]
        for rid in ids:
            terminal = [t for t in server.event_types(rid) if t.startswith("Request")][-1]
            assert terminal == "RequestCancelled", (rid, server.event_types(rid))
            entry = server.wait_billed(rid)
            record = poll(f"the engine's record of {rid}", lambda r=rid: replica.record(r), 10)
            generated = record["completion_tokens"]
            assert generated < MAX_TOKENS, f"{rid}: the engine generated all {generated}"
            assert entry["completion_tokens"] == generated, (rid, dict(entry), record)
    finally:
        for sock in sockets:
            sock.close()
        time.sleep(0.2)
