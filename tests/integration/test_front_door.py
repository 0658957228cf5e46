"""`tollgate dev-cluster`'s front address passes over an edge that refuses connections."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tollgate_llm.cli.dev.cluster import FrontDoor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"edge"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def live_edge() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_every_connection_reaches_the_edge_that_is_up(live_edge: int) -> None:
    dead = _free_port()  # nothing listens there: an edge killed
    front = FrontDoor("127.0.0.1", _free_port(), [("127.0.0.1", dead), ("127.0.0.1", live_edge)])
    front.start()
    try:
        for _ in range(6):  # a new connection each, so each takes the next turn
            r = httpx.get(f"http://127.0.0.1:{front.port}/", timeout=5)
            assert (r.status_code, r.text) == (200, "edge")
    finally:
        front.stop()


def test_a_connection_no_edge_takes_is_closed() -> None:
    front = FrontDoor("127.0.0.1", _free_port(), [("127.0.0.1", _free_port())])
    front.start()
    try:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{front.port}/", timeout=5)
    finally:
        front.stop()
