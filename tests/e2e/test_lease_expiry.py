"""An edge killed with -9 mid-stream: the restarted server's sweeper expires the lease 15 s after
the last renewal and bills exactly the progress that renewal carried."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import SLOW, SLOW_MODEL, Server, auth, long_body, poll, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def lone_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "lease", [(SLOW_MODEL, SLOW)]) as server:
        yield server


def renewals_for(server: Server, request_id: str) -> list[dict]:
    out = []
    for row in server.query(
        "SELECT payload FROM events WHERE type = 'LeasesRenewed' ORDER BY position"
    ):
        for p in json.loads(row["payload"])["progress"]:
            if p["request_id"] == request_id:
                out.append(p)
    return out


def test_lease_expires_after_the_edge_is_killed(lone_server: Server) -> None:
    server = lone_server
    client = httpx.Client(timeout=60)
    stream = client.send(
        client.build_request("POST", f"{server.base}/v1/chat/completions",
                             headers=auth(server.keys["demo-enterprise"]),
                             json=long_body(SLOW_MODEL, 3000, stream=True)),
        stream=True,
    )
    try:
        assert stream.status_code == 200
        request_id = stream.headers["x-request-id"]
        lines = stream.iter_lines()
        next(lines)
        poll(
            "a LeasesRenewed event carrying progress for the request",
            lambda: any(p["completion_tokens"] > 0 for p in renewals_for(server, request_id)),
            timeout=15, every=0.25,
        )
        server.kill9()
    finally:
        stream.close()
        client.close()
    assert "LeaseExpired" not in server.event_types(request_id)
    last = renewals_for(server, request_id)[-1]  # the edge is dead: nothing renews any more

    server.start()  # same data dir, same replicas
    expired = poll(
        "LeaseExpired for the request of the killed edge",
        lambda: [p for t, p in server.events(request_id) if t == "LeaseExpired"],
        timeout=30, every=0.5,
    )
    assert len(expired) == 1
    assert (expired[0]["prompt_tokens"], expired[0]["completion_tokens"],
            expired[0]["cached_tokens"]) == (
        last["prompt_tokens"], last["completion_tokens"], last["cached_tokens"],
    )
    entry = server.wait_billed(request_id)
    types = server.event_types(request_id)
    assert types[-3:] == ["LeaseExpired", "QuotaRefunded", "UsageBilled"], types
    assert entry["completion_tokens"] == last["completion_tokens"]
    assert entry["prompt_tokens"] == last["prompt_tokens"]
    assert entry["terminal"] in ("lease_expired", "LeaseExpired", "expired")
    server.assert_lifecycle()
    # The engine stopped generating when the edge's connection died.
    assert server.replicas[0].metric("vllm:num_requests_running") == 0
