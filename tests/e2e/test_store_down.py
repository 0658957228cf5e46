"""A store that is down is a 503, never a 500 (issue 26, item 5): `tollgate serve` on a private
PostgreSQL cluster the test starts on its own port; the cluster is stopped (`-m fast`, then
`-m immediate`) and every route is asked while it is down. Each answer that is not a success or
the client's own error is a 503 with `Retry-After` and an OpenAI-style error body (`type`,
`code`, `message`); none is a 500, and nothing is admitted. Started again, the server answers
as before."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, short_body, start_replica
from tests.pg_cluster import PrivateCluster, private_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, PrivateCluster]]:
    tmp = tmp_path_factory.mktemp("store-down")
    with private_cluster(tmp) as cluster:
        replica = start_replica(tmp, MODEL, seed=26, **FAST)
        server = Server(tmp, [replica], serve_args=["--database-url", cluster.url])
        try:
            server.start()
            server.cli(
                "prices",
                "set",
                "--model",
                MODEL,
                "--prompt",
                "10",
                "--completion",
                "30",
                "--cached",
                "5",
            )
            yield server, cluster
        finally:
            server.stop()
            replica.stop()


def _asks(server: Server) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx options) of every route family a customer or an admin reaches."""
    customer = auth(server.keys["demo-enterprise"])
    admin = auth(server.keys["finance"])
    support = auth(server.keys["support"])
    chat = "/v1/chat/completions"
    return [
        ("POST", chat, {"headers": customer, "json": short_body()}),
        ("POST", chat, {"headers": customer, "json": short_body(stream=True)}),
        ("POST", chat, {"headers": {**customer, "Idempotency-Key": uuid.uuid4().hex},
                        "json": short_body()}),
        ("GET", "/v1/models", {"headers": customer}),
        ("GET", "/v1/billing/usage", {"headers": customer}),
        ("GET", "/v1/billing/ledger", {"headers": customer}),
        ("GET", "/v1/billing/goodput", {"headers": admin}),
        ("GET", "/v1/billing/reconciliation", {"headers": admin}),
        ("GET", f"/v1/requests/req_{uuid.uuid4().hex}/events", {"headers": admin}),
        ("GET", "/v1/requests", {"headers": support, "params": {"tenant": "demo-enterprise"}}),
        ("GET", "/v1/requests", {"headers": customer, "params": {"limit": 5}}),
        ("POST", "/v1/runs", {"headers": customer, "json": {"id": "run-1", "max_calls": 2}}),
        ("GET", "/v1/batches/batch_x", {"headers": customer}),
        ("POST", "/v1/files", {"headers": customer, "data": {"purpose": "batch"},
                               "files": {"file": ("in.jsonl", _batch_line())}}),
        ("GET", "/v1/fleet", {"headers": admin}),
    ]  # fmt: skip


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_every_route_answers_503_with_retry_after_while_the_store_is_down(
    served: tuple[Server, PrivateCluster], mode: str
) -> None:
    server, cluster = served
    admitted_before = _admitted(server)
    cluster.halt(mode)
    answers: list[tuple[str, str, int, dict[str, Any], dict[str, str]]] = []
    try:
        with httpx.Client(base_url=server.base, timeout=30) as client:
            for _ in range(2):  # the second time, with every pooled connection already dead
                for method, path, options in _asks(server):
                    r = client.request(method, path, **options)
                    try:
                        body = r.json()
                    except ValueError:
                        body = {"raw": r.text[:200]}
                    answers.append((method, path, r.status_code, body, dict(r.headers)))
    finally:
        cluster.start()
    for method, path, status, body, _ in answers:
        print(f"store down ({mode}): {method} {path} -> {status} {body.get('error', '')}")
    broken = [(m, p, s, b) for m, p, s, b, _ in answers if s >= 500 and s != 503]
    assert broken == []
    unavailable = [(m, p, b, h) for m, p, s, b, h in answers if s == 503]
    assert unavailable, "no route touched the store while it was down"
    for method, path, body, headers in unavailable:
        assert int(headers.get("retry-after", "0")) >= 1, (method, path, headers)
        error = body.get("error") or {}
        assert error.get("type") and error.get("code") and error.get("message"), (path, body)
    chats = [s for m, p, s, _, _ in answers if p == "/v1/chat/completions"]
    assert set(chats) == {503}
    # The request list reads the store on every page: down, it is the 503, never a page.
    assert {s for _, p, s, _, _ in answers if p == "/v1/requests"} == {503}
    # Back up: the same server admits and bills again, and admitted nothing while it was down.
    poll("the server to admit again", lambda: _chat_ok(server), timeout=30, every=0.5)
    assert _admitted(server) == admitted_before + 1
    listed = httpx.get(f"{server.base}/v1/requests", headers=auth(server.keys["support"]),
                       params={"tenant": "demo-enterprise"}, timeout=30)  # fmt: skip
    assert listed.status_code == 200 and listed.json()["object"] == "list", listed.text


def _batch_line() -> bytes:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": short_body()}  # fmt: skip
    return json.dumps(line).encode() + b"\n"


def _chat_ok(server: Server) -> bool:
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        headers=auth(server.keys["demo-enterprise"]),
        json=short_body(),
        timeout=30,
    )
    return r.status_code == 200


def _admitted(server: Server) -> int:
    import psycopg

    url = server.serve_args[1].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM events WHERE type = 'RequestAdmitted'").fetchone()
    return int(row[0]) if row else 0
