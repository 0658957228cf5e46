"""Hole 1 of issue 14: refused requests cannot write unbounded data into the event log. Every
stored or echoed field is bounded, refusals count against a per-key budget (the plan's requests
per minute), and failed authentications against a per-address one."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, running_server, short_body

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
AUTH_FAILURES_PER_MINUTE = 10


def post(server: Server, secret: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.base}/v1/chat/completions", headers={**auth(secret), **headers}, json=body,
        timeout=60,
    )


def stored_bytes(server: Server) -> int:
    return sum(p.stat().st_size for p in server.data_dir.glob("tollgate.db*"))


def test_a_megabyte_model_name_is_refused_small_unstored_and_rate_limited(server: Server) -> None:
    """Before: 25 requests with a 1 MiB `model` from a free key all answered 404 echoing the name,
    and grew the database by ~50 MB (the name stored whole in RequestRejected and request_log)."""
    rpm = 5
    tenant = server.new_tenant("flood", plan="free", rpm=rpm)
    before = stored_bytes(server)
    started = time.monotonic()
    answers = [post(server, tenant.secret, short_body(model="m" * MIB)) for _ in range(25)]
    elapsed_s = time.monotonic() - started

    statuses = [r.status_code for r in answers]
    assert all(400 <= s < 500 for s in statuses), statuses
    assert max(len(r.content) for r in answers) < 2048  # the name is never echoed whole
    first = answers[0].json()["error"]
    assert (answers[0].status_code, first["param"]) == (400, "model")
    assert first["code"] == "string_above_max_length"
    # The key's budget is its plan's requests per minute, refilled continuously: the first `rpm`
    # refusals are answered as refusals, then at most one more per 60/rpm seconds, and the rest
    # are 429 with a Retry-After.
    refused = [r for r in answers if r.status_code == 400]
    throttled = [r for r in answers if r.status_code == 429]
    assert statuses[:rpm] == [400] * rpm
    assert len(refused) <= rpm + math.ceil(elapsed_s * rpm / 60)
    assert len(refused) + len(throttled) == len(answers)
    for r in throttled:
        error = r.json()["error"]
        assert error["code"] == "refused_requests_rate_limited", error
        assert int(r.headers["retry-after"]) >= 1

    # Only the refusals within the budget are recorded, each small; none names the model whole.
    ids = [r.headers["x-request-id"] for r in refused]
    server.wait_event(ids[-1], "RequestRejected")
    rows = server.query(
        "SELECT stream_id, length(payload) AS n FROM events WHERE tenant_id = ?", (tenant.name,)
    )
    rejected = [r for r in rows if r["stream_id"].startswith("req_")]
    assert {r["stream_id"] for r in rejected} == set(ids)
    assert max(r["n"] for r in rejected) < 2048
    assert all(r.headers["x-request-id"] not in {x["stream_id"] for x in rows} for r in throttled)
    server.cli("projections", "rebuild", "request_log")  # the read model holds bounded rows too
    logged = server.query(
        "SELECT max(length(model)) AS n FROM request_log WHERE tenant_id = ?", (tenant.name,)
    )[0]["n"]
    assert logged is not None and logged <= 200
    grown = stored_bytes(server) - before
    print(f"refusals: 25 x 1 MiB model from a {rpm} rpm key: {len(refused)} x 400, "
          f"{len(throttled)} x 429, largest event {max(r['n'] for r in rejected)} B, "
          f"database + WAL grew {grown / 1024:.0f} KiB")
    assert grown < 5 * MIB  # was ~50 MiB (and a 52 MiB WAL)


def test_unknown_models_count_against_the_refusal_budget(server: Server) -> None:
    tenant = server.new_tenant("unknown", plan="free", rpm=3)
    statuses = [post(server, tenant.secret, short_body(model=f"no-such-{i}")).status_code
                for i in range(6)]
    assert statuses[:3] == [404, 404, 404]
    assert 429 in statuses[3:]
    # A valid request still goes through: the budget is for refusals only.
    ok = post(server, tenant.secret, short_body(tokens=2))
    assert ok.status_code == 200, ok.text


def test_an_idempotency_key_over_255_characters_is_refused_naming_it(server: Server) -> None:
    secret = server.keys["demo-standard"]
    for key in ("k" * 256, "tab\tinside", ""):
        r = post(server, secret, short_body(), **{"Idempotency-Key": key})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "Idempotency-Key"
        assert len(r.content) < 1024
    assert post(server, secret, short_body(tokens=2), **{"Idempotency-Key": "k" * 255}).is_success


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own: the address budget is per client address, and every test here
    connects from 127.0.0.1."""
    with running_server(
        tmp_path_factory, "auth-limit", [(MODEL, FAST)],
        serve_args=["--auth-failures-per-minute", str(AUTH_FAILURES_PER_MINUTE)],
    ) as s:
        yield s


def test_failed_authentications_are_limited_per_address(strict_server: Server) -> None:
    server = strict_server
    statuses = []
    for i in range(AUTH_FAILURES_PER_MINUTE + 5):
        r = httpx.get(f"{server.base}/v1/models", headers=auth(f"tg_wrong-{i}"), timeout=10)
        statuses.append(r.status_code)
    assert statuses[:AUTH_FAILURES_PER_MINUTE] == [401] * AUTH_FAILURES_PER_MINUTE
    assert 429 in statuses[AUTH_FAILURES_PER_MINUTE:]
    # While the address is over its budget every authentication from it is refused, a valid key
    # included (else the budget would not slow a guesser down), on every route.
    good = server.keys["demo-standard"]
    for r in (
        httpx.get(f"{server.base}/v1/models", headers=auth(good), timeout=10),
        post(server, good, short_body(tokens=2)),
    ):
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "authentication_failures_rate_limited"
        assert int(r.headers["retry-after"]) >= 1


@pytest.fixture(scope="module")
def proxied_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Behind a proxy at 127.0.0.1 (trusted): each test client names its own address in
    X-Forwarded-For, as a load balancer would."""
    with running_server(
        tmp_path_factory, "auth-doors", [(MODEL, FAST)],
        serve_args=["--auth-failures-per-minute", str(AUTH_FAILURES_PER_MINUTE),
                    "--trusted-proxies", "127.0.0.1/32"],
    ) as s:  # fmt: skip
        yield s


def _from(address: str, **headers: str) -> dict[str, str]:
    return {"X-Forwarded-For": address, **headers}


@pytest.mark.parametrize("door", ["ui_login", "ui_bearer", "batch_item"])
def test_every_authentication_path_is_one_limit(proxied_server: Server, door: str) -> None:
    """Issue 27, item 7: bad credentials through the sign-in form, a bearer header on a web
    page and the batch runner's header each count against the one per-address limit, and an
    address limited through one door is limited through every other (the API included)."""
    server = proxied_server
    address = {"ui_login": "203.0.113.10", "ui_bearer": "203.0.113.11",
               "batch_item": "203.0.113.12"}[door]  # fmt: skip
    statuses = []
    with httpx.Client(base_url=server.base, timeout=10, follow_redirects=False) as client:
        for i in range(AUTH_FAILURES_PER_MINUTE + 3):
            if door == "ui_login":
                r = client.post("/ui/login", data={"key": f"tg_wrong-{i}"}, headers=_from(address))
            elif door == "ui_bearer":
                r = client.get("/ui/finance", headers=_from(address, **auth(f"tg_wrong-{i}")))
            else:
                r = client.post(
                    "/v1/chat/completions", json=short_body(tokens=2),
                    headers=_from(address, **auth(f"tg_wrong-{i}"),
                                  **{"X-Tollgate-Batch-Item": "batch_x/1",
                                     "X-Tollgate-On-Behalf-Of": "key-1"}),
                )  # fmt: skip
            statuses.append(r.status_code)
        assert statuses[:AUTH_FAILURES_PER_MINUTE] == [401] * AUTH_FAILURES_PER_MINUTE, statuses
        assert statuses[AUTH_FAILURES_PER_MINUTE:] == [429] * 3, statuses
        good = server.keys["demo-standard"]
        # Limited everywhere, a valid key included: the API and the sign-in form alike.
        api = client.get("/v1/models", headers=_from(address, **auth(good)))
        assert api.status_code == 429
        signed_in = client.post("/ui/login", data={"key": good}, headers=_from(address))
        assert signed_in.status_code == 429
        # Another client behind the same proxy is not.
        other = client.get("/v1/models", headers=_from("203.0.113.99", **auth(good)))
        assert other.status_code == 200
