"""Downgrade only with consent (seed 004, invariant 10): a request whose model has no capacity is
never served by another model unless its tenant said it may be, and then it says so.

Its own server: the requested model on one replica with a tiny KV cache (64 blocks of 16), held
above the free tier's 0.60 ceiling by one long enterprise stream; the other model beside it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, SLOW_MODEL, Server, auth, poll, running_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    small = {"num_gpu_blocks": 64, "max_model_len": 1024, "step_base_ms": 60, "speed": 1}
    with running_server(tmp_path_factory, "fallbacks", [(MODEL, small), (SLOW_MODEL, FAST)]) as s:
        yield s


def ask(server: Server) -> httpx.Response:
    body = {"model": "llama-3.1-8b", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello there!"}]}
    return httpx.post(f"{server.base}/v1/chat/completions", headers=auth(server.keys["demo-free"]),
                      json=body, timeout=30)


def test_another_model_serves_only_with_consent_and_says_so(fleet: Server) -> None:
    server = fleet
    small = next(r for r in server.replicas if r.model == MODEL)
    other = next(r for r in server.replicas if r.model == SLOW_MODEL)
    hold = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": " ".join(["abc"] * 690)}]}
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", f"{server.base}/v1/chat/completions",
        headers=auth(server.keys["demo-enterprise"]), json=hold,
    ) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        poll("the small replica's KV to pass 0.60",
             lambda: small.metric("vllm:kv_cache_usage_perc") > 0.6, timeout=10)

        def refused() -> httpx.Response | None:
            r = ask(server)
            assert r.status_code in (200, 503), r.text
            return r if r.status_code == 503 else None

        # Saturated and no consent: 503, and the other model never sees the request.
        r = poll("a capacity refusal without consent", refused, timeout=10, every=0.3)
        assert "x-tollgate-downgraded-from" not in r.headers
        served_before = other.metric("vllm:request_success_total")

        server.cli("fallbacks", "allow", "--tenant", "demo-free", "--from", "llama-3.1-8b",
                   "--to", "llama-3.1-70b")

        def downgraded() -> httpx.Response | None:
            r = ask(server)
            return r if r.status_code == 200 else None

        ok = poll("a downgraded answer once consent is given", downgraded, timeout=10, every=0.3)
        assert ok.headers["x-tollgate-downgraded-from"] == MODEL
        assert ok.json()["model"] == SLOW_MODEL
        rid = ok.headers["x-request-id"]
        assert "RequestDowngraded" in server.event_types(rid)
        entry = server.wait_billed(rid)
        assert entry["model"] == SLOW_MODEL  # billed at the model that served it
        poll("the other model to count it",
             lambda: other.metric("vllm:request_success_total") > served_before)

        server.cli("fallbacks", "revoke", "--tenant", "demo-free", "--from", "llama-3.1-8b",
                   "--to", "llama-3.1-70b")
        r = poll("a refusal again once consent is revoked", refused, timeout=10, every=0.3)
        assert "x-tollgate-downgraded-from" not in r.headers
