"""Bad input is refused before admission with an OpenAI-shaped error naming the field; faults
after the first token are an in-stream error then [DONE]; nothing admitted is left unended."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server, Tenant, auth, short_body

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tenants(server: Server) -> dict[str, Tenant]:
    return server.new_tenants({
        "small": {"max_context": 60, "max_output": 16},
        "revoke": {},
    })


def nested_body(field: str, template: str, levels: int) -> bytes:
    """short_body() with `field` set to `template`, whose DEEP is `levels` nested arrays."""
    deep = "[" * levels + "1" + "]" * levels
    rest = json.dumps({k: v for k, v in short_body().items() if k != field})
    return (rest[:-1] + f', "{field}": ' + template.replace("DEEP", deep) + "}").encode()


def chat(server: Server, secret: str, body: object = None, *, content: bytes | None = None,
         extra: dict[str, str] | None = None) -> httpx.Response:
    kwargs = {"content": content} if content is not None else {"json": body}
    return httpx.post(
        f"{server.base}/v1/chat/completions",
        headers={**auth(secret), "Content-Type": "application/json", **(extra or {})},
        timeout=30, **kwargs,
    )


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert r.headers["x-request-id"].startswith("req_")
    return error


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"model": "x", "messages": [', None),  # malformed JSON
        (b'[1, 2]', None),
        (json.dumps({"model": MODEL}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
        (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(),
         "messages[0].role"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
         "messages[0].content"),
        (json.dumps({**short_body(), "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({**short_body(), "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({**short_body(), "temperature": 7}).encode(), "temperature"),
        (json.dumps({**short_body(), "stream": "yes"}).encode(), "stream"),
        (json.dumps({**short_body(), "stream_options": {"include_usage": True}}).encode(),
         "stream_options"),
        (json.dumps({**short_body(), "n": 3}).encode(), "n"),
        # Issue 14, hole 3: each of these used to answer 200.
        (json.dumps({**short_body(), "tools": "x"}).encode(), "tools"),
        (json.dumps({**short_body(), "tool_choice": 5}).encode(), "tool_choice"),
        (json.dumps({**short_body(), "response_format": {"type": "yaml"}}).encode(),
         "response_format.type"),
        (json.dumps({**short_body(), "logprobs": "yes"}).encode(), "logprobs"),
        (json.dumps({**short_body(), "logprobs": True, "top_logprobs": 1000}).encode(),
         "top_logprobs"),
        (json.dumps({**short_body(), "stop": 5}).encode(), "stop"),
        (json.dumps({**short_body(), "presence_penalty": "x"}).encode(), "presence_penalty"),
        (json.dumps({**short_body(), "top_k": -5}).encode(), "top_k"),
        (json.dumps({**short_body(), "messages": [{"role": "user", "content": [1, 2]}]}).encode(),
         "messages[0].content[0]"),
        # Hole 2: parsed (orjson.loads takes 1,024 levels), then admitted and failed at the
        # engine adapter's orjson.dumps (255).
        (nested_body("tools", '[{"type": "function", "function": {"name": "f", "parameters": '
                     '{"a": DEEP}}}]', 300), "tools"),
        (nested_body("response_format", '{"type": "json_schema", "json_schema": {"name": "s", '
                     '"schema": {"a": DEEP}}}', 256), "response_format"),
        (nested_body("logit_bias", '{"1": DEEP}', 256), "logit_bias"),
        (nested_body("messages", '[{"role": "user", "content": [{"type": "text", "text": "x", '
                     '"extra": DEEP}]}]', 1000), "messages[0].content"),
    ],
)
def test_invalid_body_is_400_naming_the_field(
    server: Server, raw: bytes, param: str | None
) -> None:
    r = chat(server, server.keys["demo-standard"], content=raw)
    error = assert_error(r, 400, param)
    if param is None:
        assert error["param"] is None
    assert "retry-after" not in r.headers
    rejected = server.wait_event(r.headers["x-request-id"], "RequestRejected")
    assert rejected["reason"] == "invalid"
    assert server.event_types(r.headers["x-request-id"]) == ["RequestRejected"]


def test_unknown_model_is_404(server: Server) -> None:
    r = chat(server, server.keys["demo-standard"], short_body(model="gpt-17-turbo"))
    error = assert_error(r, 404, "model")
    assert error["code"] == "model_not_found"


def test_prompt_over_max_context_is_400(server: Server, tenants) -> None:
    long_prompt = " ".join(["word"] * 200)
    r = chat(server, tenants["small"].secret,
             {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]})
    error = assert_error(r, 400, "messages")
    assert "max_context" in error["message"]
    server.wait_event(r.headers["x-request-id"], "RequestRejected")
    assert server.event_types(r.headers["x-request-id"]) == ["RequestRejected"]


def test_prompt_over_the_models_context_is_400_before_admission(server: Server) -> None:
    # Within the enterprise plan's max_context (131,072), beyond the replicas' own context:
    # refused with the model's limit, not admitted and then failed by the engine.
    context = httpx.get(f"{server.replicas[0].url}/v1/models", timeout=10).json()["data"][0][
        "max_model_len"
    ]
    words = " ".join(["word"] * (context + 16))
    r = chat(server, server.keys["demo-enterprise"],
             {"model": MODEL, "messages": [{"role": "user", "content": words}]})  # fmt: skip
    error = assert_error(r, 400, "messages")
    assert f"context of {context} tokens" in error["message"]
    server.wait_event(r.headers["x-request-id"], "RequestRejected")
    assert server.event_types(r.headers["x-request-id"]) == ["RequestRejected"]


def test_max_tokens_over_max_output_is_clamped(server: Server, tenants) -> None:
    r = chat(server, tenants["small"].secret, short_body(tokens=1000, ignore_eos=True))
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    assert r.json()["usage"]["completion_tokens"] == 16  # max_output, not 1000
    estimated = next(p for t, p in server.events(request_id) if t == "RequestEstimated")
    assert estimated["reserved_output_tokens"] == 16
    routed = next(p for t, p in server.events(request_id) if t == "RequestRouted")
    record = server.replica(routed["replica_id"]).record(request_id)
    assert record is not None and record["completion_tokens"] == 16
    assert server.wait_billed(request_id)["completion_tokens"] == 16


def test_bad_and_revoked_keys_are_401(server: Server, tenants) -> None:
    for headers in ({}, {"Authorization": "Bearer tg_not-a-key"},
                    {"Authorization": "Basic abc"}):
        r = httpx.post(f"{server.base}/v1/chat/completions", headers=headers,
                       json=short_body(), timeout=30)
        error = assert_error(r, 401, type_="authentication_error")
        assert error["code"] == "invalid_api_key"
    tenant = tenants["revoke"]
    assert chat(server, tenant.secret, short_body(tokens=2)).status_code == 200
    server.cli("keys", "revoke", tenant.key_id, "--tenant", tenant.name)
    server.wait_key(tenant.secret, valid=False)
    error = assert_error(chat(server, tenant.secret, short_body()), 401,
                         type_="authentication_error")
    assert "revoked" in error["message"]
    # A finance key is not a customer key.
    r = chat(server, server.keys["finance"], short_body())
    assert_error(r, 403, type_="permission_error")


def test_body_over_4_mib_is_413(server: Server) -> None:
    big = json.dumps({**short_body(), "messages": [
        {"role": "user", "content": "x" * (4 * 1024 * 1024 + 10)}]}).encode()
    r = chat(server, server.keys["demo-standard"], content=big)
    assert_error(r, 413)


def test_replica_dying_mid_stream_is_an_in_stream_error_then_done(server: Server) -> None:
    secret = server.keys["demo-standard"]
    r = chat(server, secret, short_body(tokens=100, ignore_eos=True, stream=True,
                                        sim_drop_after_tokens=5))
    assert r.status_code == 200  # the first token was out: the status was already sent
    frames = [f for f in r.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][6:])["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_failed"
    content = [json.loads(f[6:]) for f in frames[:-2]]
    assert all("error" not in c for c in content)
    request_id = r.headers["x-request-id"]
    entry = server.wait_billed(request_id)
    failed = [p for t, p in server.events(request_id) if t == "RequestFailed"]
    assert len(failed) == 1, server.event_types(request_id)
    routed = next(p for t, p in server.events(request_id) if t == "RequestRouted")
    record = server.replica(routed["replica_id"]).record(request_id)
    assert record["completion_tokens"] >= 5
    # the tokens the engine sent before the connection died are billed, exactly
    assert failed[0]["completion_tokens"] == record["completion_tokens"]
    assert entry["completion_tokens"] == record["completion_tokens"]
    assert entry["prompt_tokens"] == record["prompt_tokens"]
    assert entry["terminal"] == "failed"


@pytest.mark.parametrize("stream", [True, False])
def test_engine_error_mid_generation(server: Server, stream: bool) -> None:
    secret = server.keys["demo-standard"]
    r = chat(server, secret, short_body(tokens=100, ignore_eos=True, stream=stream,
                                        sim_fail_after_tokens=4))
    request_id = r.headers["x-request-id"]
    if stream:
        assert r.status_code == 200
        frames = [f for f in r.text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        assert "error" in json.loads(frames[-2][6:])
    else:
        # nothing was sent yet: a real status, never a truncated completion
        assert_error(r, 502, type_="server_error")
    entry = server.wait_billed(request_id)
    assert entry["terminal"] == "failed"
    routed = next(p for t, p in server.events(request_id) if t == "RequestRouted")
    record = server.replica(routed["replica_id"]).record(request_id)
    assert record["finish_reason"] == "error"
    assert entry["completion_tokens"] == record["completion_tokens"]
    assert entry["prompt_tokens"] == record["prompt_tokens"]


def test_every_admitted_request_has_one_end_one_refund_one_bill(server: Server) -> None:
    """DESIGN §4.2 over everything the shared server has seen so far (this runs last here),
    and every fold healthy: refusals (rejected requests) are folded too."""
    server.assert_lifecycle()
    ready = httpx.get(f"{server.base}/readyz", timeout=5).json()
    assert ready["problems"] == [], ready
    rejected = server.query(
        "SELECT count(*) AS n FROM events e WHERE type = 'RequestRejected' AND NOT EXISTS "
        "(SELECT 1 FROM request_log r WHERE r.request_id = e.stream_id)"
    )[0]["n"]
    assert rejected == 0, "rejected requests missing from request_log"


def test_logprobs_come_from_the_engine_when_streamed(server: Server) -> None:
    """Hole 3: `logprobs: true` answered `logprobs: null` (the simulated replica ignored it). The
    streamed chunks now carry the engine's logprobs, one entry per token, as vLLM's do."""
    r = chat(server, server.keys["demo-standard"], short_body(
        tokens=6, ignore_eos=True, stream=True, logprobs=True, top_logprobs=3,
        stream_options={"include_usage": True},
    ))
    assert r.status_code == 200, r.text
    chunks = [json.loads(f[6:]) for f in r.text.split("\n\n") if f and f != "data: [DONE]"]
    entries = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        if choice.get("logprobs")
        for entry in choice["logprobs"]["content"]
    ]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "".join(e["token"] for e in entries) == text
    for entry in entries:
        assert entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode() == entry["token"]
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]


def test_logprobs_come_from_the_engine_when_not_streamed(server: Server) -> None:
    """The non-streamed answer assembles the engine's per-token logprobs (it said null)."""
    r = chat(server, server.keys["demo-standard"], short_body(
        tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2,
    ))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == r.json()["usage"]["completion_tokens"] == 5
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    plain = chat(server, server.keys["demo-standard"], short_body(tokens=3))
    assert plain.json()["choices"][0]["logprobs"] is None


def test_unknown_routes_and_methods_answer_openais_error_object(server: Server) -> None:
    key = auth(server.keys["demo-standard"])
    unknown = httpx.get(f"{server.base}/v1/no-such-route", headers=key, timeout=10)
    error = unknown.json()["error"]
    assert unknown.status_code == 404 and error["code"] == "unknown_url"
    assert error["type"] == "invalid_request_error" and "/v1/no-such-route" in error["message"]
    assert "detail" not in unknown.json() and unknown.headers["x-request-id"]
    wrong = httpx.delete(f"{server.base}/v1/models", headers=key, timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert "GET" in wrong.headers["allow"]
