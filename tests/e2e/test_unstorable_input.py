"""Nothing a client sends reaches storage unless every backend can store it (DESIGN.md invariant
12; issue 26 item 2(a), issue 27 items 2 and 8): over real HTTP against `tollgate serve`, every
field that is recorded refuses a NUL (and what else cannot be stored or sent) with a 400 naming
it, and afterwards no table holds a NUL. On PostgreSQL the same requests leave `/readyz` at 200
and the next ordinary request billed — one customer's `"model": "a\\u0000b"` used to stop
billing for every tenant there."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import POSTGRES_URL
from tests.e2e.conftest import (
    FAST,
    MODEL,
    Server,
    auth,
    poll,
    running_server,
    short_body,
    start_replica,
)
from tests.e2e.test_budgets_postgres import PostgresServer

pytestmark = pytest.mark.e2e

NUL = "\x00"
HEAD = '"method": "POST", "url": "/v1/chat/completions"'
BODY = '"body": {"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own: its whole database is scanned for NUL afterwards."""
    with running_server(tmp_path_factory, "unstorable", [(MODEL, FAST)]) as s:
        yield s


def post(server: Server, path: str, key: str, *, headers: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base}{path}", headers=headers or auth(server.keys[key]), timeout=30, **kw
    )


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert NUL not in r.text and "\\u0000" not in r.text  # the bad bytes are not echoed


TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}

CHAT_CASES = [
    ({"model": "a\x00b"}, "model"),
    ({"model": MODEL + "\x00"}, "model"),
    ({"user": "end-user\x00"}, "user"),
    ({"metadata": {"foo": "a\x00b"}}, "metadata.foo"),
    ({"metadata": {"f\x00o": "b"}}, "metadata"),
    (
        {"tools": [{**TOOL, "function": {**TOOL["function"], "name": "get\n"}}]},
        "tools[0].function.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "out\n"}}},
        "response_format.json_schema.name",
    ),
]


def chat_cases(server: Server) -> None:
    for fields, param in CHAT_CASES:
        assert_400(post(server, "/v1/chat/completions", "demo-standard",
                        json={**short_body(), **fields}), param)  # fmt: skip


def batch_line(custom_id_json: str, model: str = MODEL) -> bytes:
    """One batch line written as JSON text, so escapes reach the server as sent."""
    return ('{"custom_id": ' + custom_id_json + ", " + HEAD + ", " + BODY % model + "}\n").encode(
        "utf-8", "surrogatepass"
    )


def multipart(filename: bytes, content: bytes, purpose: bytes = b"batch") -> tuple[str, bytes]:
    """A multipart/form-data body written by hand: clients percent-encode a NUL in a file name,
    a hostile one need not."""
    boundary = uuid.uuid4().hex
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode()
        + purpose
        + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
        + filename
        + b'"\r\nContent-Type: application/jsonl\r\n\r\n'
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return f"multipart/form-data; boundary={boundary}", body


def upload(server: Server, content: bytes, filename: bytes = b"in.jsonl") -> httpx.Response:
    content_type, body = multipart(filename, content)
    headers = {**auth(server.keys["demo-standard"]), "Content-Type": content_type}
    return post(server, "/v1/files", "demo-standard", headers=headers, content=body)


UPLOAD_CASES = [
    # Issue 27 item 2: each passed the upload and then could never be sent.
    (batch_line('"x\\ny"'), "line 1: custom_id"),
    (batch_line('"caf\\u00e9"'), "line 1: custom_id"),
    (batch_line('"\\ud800"'), "line 1: custom_id"),
    (batch_line('"x\\u0000"'), "line 1: custom_id"),
    (
        batch_line('"ok"')
        + batch_line('"ok-2"').replace(b'"max_tokens": 4', b'"seed": 18446744073709551616'),
        "line 2: body.seed",
    ),
    (batch_line('"ok"', model="a\\u0000b"), "line 1: body.model"),
]


def upload_cases(server: Server) -> None:
    for content, param in UPLOAD_CASES:
        assert_400(upload(server, content), param)
    assert_400(upload(server, batch_line('"ok"'), filename=b"in\x00.jsonl"), "file.filename")


def run_cases(server: Server) -> None:
    assert_400(post(server, "/v1/runs", "demo-standard", json={"id": "run-1\n"}), "id")
    assert_400(post(server, "/v1/runs", "demo-standard", json={"project": "p\x00"}), "project")
    assert_400(post(server, "/v1/runs", "demo-standard",
                    json={"max_wall_seconds": 999_999_999_999}), "max_wall_seconds")  # fmt: skip


def two_authorizations(server: Server) -> None:
    """Issue 27 item 8: chat read the last header and every other route the first."""
    good, other = server.keys["demo-standard"], server.keys["demo-enterprise"]
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/batches"), ("POST", "/v1/runs"),
                         ("GET", "/v1/billing/usage")]:  # fmt: skip
        headers = [("Authorization", f"Bearer {good}"), ("Authorization", f"Bearer {other}")]
        r = httpx.request(method, f"{server.base}{path}", headers=headers, timeout=30,
                          json=short_body() if method == "POST" else None)  # fmt: skip
        assert_400(r, "Authorization")


def filter_cases(server: Server) -> None:
    """Billing filters are compared with stored text: PostgreSQL refused the NUL (a 500)."""
    for path, param in [("/v1/billing/usage", "model"), ("/v1/billing/ledger", "model"),
                        ("/v1/billing/ledger", "after")]:  # fmt: skip
        r = httpx.get(f"{server.base}{path}", params={param: "a\x00b"},
                      headers=auth(server.keys["demo-standard"]), timeout=30)  # fmt: skip
        assert_400(r, param)


def id_cases(server: Server) -> None:
    """Ids and cursors are compared with stored text too (a 500 on PostgreSQL)."""
    key = auth(server.keys["demo-standard"])
    for method, path, params, param in [
        ("GET", "/v1/files/file-a%00b", None, "file_id"),
        ("GET", "/v1/files/file-a%00b/content", None, "file_id"),
        ("DELETE", "/v1/files/file-a%00b", None, "file_id"),
        ("GET", "/v1/batches/batch_a%00b", None, "batch_id"),
        ("POST", "/v1/batches/batch_a%00b/cancel", None, "batch_id"),
        ("GET", "/v1/batches", {"after": "batch_a\x00b"}, "after"),
    ]:
        r = httpx.request(method, f"{server.base}{path}", params=params, headers=key, timeout=30)
        assert_400(r, param)


def every_bad_input(server: Server) -> None:
    id_cases(server)
    chat_cases(server)
    filter_cases(server)
    upload_cases(server)
    run_cases(server)
    two_authorizations(server)
    # A batch's metadata is recorded in its BatchCreated event.
    r = upload(server, batch_line('"ok"'))
    assert r.status_code == 200, r.text
    assert_400(post(server, "/v1/batches", "demo-standard", json={
        "input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h", "metadata": {"k": "a\x00"},
    }), "metadata.k")  # fmt: skip


def test_every_recorded_field_refuses_what_a_backend_cannot_store(quiet: Server) -> None:
    every_bad_input(quiet)
    ok = post(quiet, "/v1/chat/completions", "demo-standard", json=short_body())
    assert ok.status_code == 200, ok.text
    quiet.wait_billed(ok.headers["x-request-id"])
    # No text or blob in any table holds a NUL, raw or escaped in an event's JSON.
    tables = [r["name"] for r in quiet.query("SELECT name FROM sqlite_master WHERE type='table'")]
    for table in tables:
        columns = [r["name"] for r in quiet.query(f'PRAGMA table_info("{table}")')]
        for column in columns:
            found = quiet.query(
                f'SELECT count(*) AS n FROM "{table}" WHERE instr(CAST("{column}" AS BLOB), '
                "x'00') > 0 OR instr(CAST(\"" + column + "\" AS BLOB), CAST('\\u0000' AS BLOB)) > 0"
            )
            assert found[0]["n"] == 0, f"{table}.{column} holds a NUL"


# --- PostgreSQL: the backend that cannot hold a NUL ------------------------------------------


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    base = make_url(POSTGRES_URL)
    conninfo = base.set(drivername="postgresql").render_as_string(hide_password=False)
    schema = f"t_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(conninfo, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {POSTGRES_URL}: {exc}")
    url = base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        tmp = tmp_path_factory.mktemp("unstorable-pg")
        replicas = [start_replica(tmp, MODEL, seed=11, **FAST)]
        server = PostgresServer(tmp, replicas, serve_args=["--database-url", url], url=url)
        try:
            server.start()
            yield server
        finally:
            server.stop()
            for r in server.replicas:
                r.stop()
            admin.execute("SET lock_timeout = '10s'")
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_on_postgres_bad_input_never_stops_billing(pg: PostgresServer) -> None:
    every_bad_input(pg)
    ok = post(pg, "/v1/chat/completions", "demo-standard", json=short_body())
    assert ok.status_code == 200, ok.text
    request_id = ok.headers["x-request-id"]
    # Billed, and its request_log row written: the projections passed every event before it.
    poll("the bill of the request after the bad ones",
         lambda: pg.query("SELECT 1 FROM ledger_entries WHERE request_id = ?", (request_id,)),
         timeout=30)  # fmt: skip
    poll("its request_log row",
         lambda: pg.query("SELECT 1 FROM request_log WHERE request_id = ?", (request_id,)),
         timeout=30)  # fmt: skip
    ready = httpx.get(f"{pg.base}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    escaped = pg.query("SELECT count(*) AS n FROM events WHERE strpos(payload, ?) > 0",
                       ("\\u0000",))  # fmt: skip
    assert escaped[0]["n"] == 0
