"""The simulated replica speaks vLLM 0.33's wire protocol: shapes checked against the examples in
vllm-protocol.md (key order and types; ids, times and values may differ), over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.simulated import (
    SimConfig,
    SimulatedReplicaHandle,
    count_prompt_tokens,
    start_simulated_replica,
)

MODEL = "my-model"
FAST = {"step_base_ms": 1.0, "per_seq_ms": 0.05, "prefill_ms_per_1k_tokens": 1.0}

# --- the examples of vllm-protocol.md, verbatim ---
DOC_NON_STREAM = b'{"id":"chatcmpl-abc123","object":"chat.completion","created":1767225600,"model":"my-model","choices":[{"index":0,"message":{"role":"assistant","content":"Hello world","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"routed_experts":null,"weight_versions":null}],"service_tier":null,"system_fingerprint":"vllm-0.33.0-1a2b3c4d","usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":0,"multimodal_tokens":null},"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'  # noqa: E501
DOC_STREAM_A = [
    b'{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"my-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',  # noqa: E501
    b'{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"my-model","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',  # noqa: E501
    b'{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"my-model","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-1a2b3c4d","kv_transfer_params":null}',  # noqa: E501
]
DOC_USAGE_CHUNK = b'{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"my-model","choices":[],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":16}},"system_fingerprint":"vllm-0.33.0-1a2b3c4d"}'  # noqa: E501
DOC_CONTINUOUS_USAGE = (
    b'{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1,"completion_tokens_details":null}'  # noqa: E501
)
DOC_404 = b'{"error":{"message":"The model `foo` does not exist. Valid aliases: my-model.","type":"NotFoundError","param":"model","code":404}}'  # noqa: E501
DOC_MIDSTREAM_ERROR = b'data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}\n\ndata: [DONE]\n\n'  # noqa: E501


def shape(v: Any) -> Any:
    """Key order and value types, values erased (null stays null: it is part of the contract)."""
    if isinstance(v, dict):
        return [(k, shape(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [shape(x) for x in v]
    if v is None:
        return None
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


def run(fn: Callable[[SimulatedReplicaHandle, aiohttp.ClientSession], Awaitable[None]], **cfg):
    async def main() -> None:
        handle = await start_simulated_replica(SimConfig(model=MODEL, **{**FAST, **cfg}))
        try:
            async with aiohttp.ClientSession() as session:
                await fn(handle, session)
        finally:
            await handle.stop()

    asyncio.run(main())


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the world, please."}],
        "max_tokens": 3,
        "ignore_eos": True,
        **kw,
    }


async def frames_of(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    out = []
    for p in parts[:-1]:
        assert p.startswith(b"data: "), p
        out.append(p[6:])
    assert out[-1] == b"[DONE]"
    return out[:-1]


def assert_compact(frame: bytes) -> None:
    assert orjson.dumps(orjson.loads(frame)) == frame  # compact separators, no reordering


def test_non_stream_body_matches_vllm_key_for_key() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        r = await s.post(
            f"{h.url}/v1/chat/completions", json=body(), headers={"X-Request-Id": "x1"}
        )
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        raw = await r.read()
        assert_compact(raw)
        got = orjson.loads(raw)
        assert shape(got) == shape(orjson.loads(DOC_NON_STREAM))
        assert got["id"] == "chatcmpl-x1"
        usage = got["usage"]
        assert usage["completion_tokens"] == 3 and got["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] == count_prompt_tokens(body()["messages"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + 3
        assert usage["prompt_tokens_details"]["cached_tokens"] % 16 == 0

    run(t)


def test_stream_without_options_matches_case_a() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        r = await s.post(f"{h.url}/v1/chat/completions", json=body(stream=True))
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        frames = await frames_of(r)
        for f in frames:
            assert_compact(f)
        chunks = [orjson.loads(f) for f in frames]
        assert shape(chunks[0]) == shape(orjson.loads(DOC_STREAM_A[0]))
        for c in chunks[1:-1]:
            assert shape(c) == shape(orjson.loads(DOC_STREAM_A[1]))
        assert shape(chunks[-1]) == shape(orjson.loads(DOC_STREAM_A[2]))
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"

    run(t)


def test_include_usage_adds_one_usage_chunk_with_prompt_details() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(stream=True, stream_options={"include_usage": True})
        r = await s.post(f"{h.url}/v1/chat/completions", json=b)
        chunks = [orjson.loads(f) for f in await frames_of(r)]
        assert shape(chunks[-1]) == shape(orjson.loads(DOC_USAGE_CHUNK))
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        # with include_usage the fingerprint moves from the finish chunk to the usage chunk
        assert "system_fingerprint" not in chunks[-2]
        assert all("usage" not in c for c in chunks[:-1])

    run(t)


def test_usage_chunk_without_prompt_details_flag() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(stream=True, stream_options={"include_usage": True})
        chunks = [
            orjson.loads(f)
            for f in await frames_of(await s.post(f"{h.url}/v1/chat/completions", json=b))
        ]
        assert list(chunks[-1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
        r = await s.post(f"{h.url}/v1/chat/completions", json=body())
        assert (await r.json())["usage"]["prompt_tokens_details"] is None

    run(t, enable_prompt_tokens_details=False)


def test_continuous_usage_on_every_chunk_including_the_role_chunk() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
        r = await s.post(f"{h.url}/v1/chat/completions", json=b)
        chunks = [orjson.loads(f) for f in await frames_of(r)]
        doc_usage = shape(orjson.loads(DOC_CONTINUOUS_USAGE))
        prompt = count_prompt_tokens(b["messages"])
        top = ["id", "object", "created", "model", "choices", "usage"]
        assert list(chunks[0]) == [*top, "prompt_token_ids", "prompt_text"]
        for c in chunks[:-1]:
            assert shape(c["usage"]) == doc_usage
            assert c["usage"]["prompt_tokens"] == prompt
        for c in chunks[1:-1]:
            assert list(c) == [*top, "kv_transfer_params"]
        assert chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk
        counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == 3
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert "prompt_tokens_details" in chunks[-1]["usage"]

    run(t)


def test_continuous_usage_without_include_usage_does_nothing() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(stream=True, stream_options={"continuous_usage_stats": True})
        chunks = [
            orjson.loads(f)
            for f in await frames_of(await s.post(f"{h.url}/v1/chat/completions", json=b))
        ]
        assert all("usage" not in c for c in chunks)

    run(t)


def test_error_bodies() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        url = f"{h.url}/v1/chat/completions"

        async def err(b: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
            r = await s.post(url, json=b, **kw)
            raw = await r.read()
            assert_compact(raw)
            return r.status, orjson.loads(raw)

        status, e = await err(body(model="foo"))
        assert status == 404 and orjson.dumps(e) == DOC_404
        status, e = await err(body(stream_options={"include_usage": True}))
        assert status == 400 and e["error"]["type"] == "BadRequestError"
        assert e["error"]["param"] == "stream_options" and e["error"]["code"] == 400
        assert e["error"]["message"].startswith("Stream options can only be defined when")
        for salt in ("", "a" * 129, "a@b", "a/b", "a\\b", "a\x00b"):
            status, e = await err(body(cache_salt=salt))
            assert status == 400 and e["error"]["param"] == "cache_salt", salt
        status, _ = await err(body(cache_salt="a" * 128))
        assert status == 200
        status, e = await err(body(messages=[{"role": "user", "content": "word " * 600}]))
        assert status == 400 and e["error"]["type"] == "BadRequestError"
        assert e["error"]["message"].startswith(
            "This model's maximum context length is 512 tokens. However, your prompt contains "
        )
        status, e = await err(body(n=2))
        assert status == 400 and e["error"]["param"] == "n"
        status, e = await err({"model": MODEL})
        assert status == 400 and e["error"]["type"] == "Bad Request"
        assert e["error"]["param"] == "body.messages"
        # unknown fields are accepted and ignored, as vLLM's extra="allow"
        status, _ = await err(body(frobnicate={"x": 1}, user="u"))
        assert status == 200
        # max_completion_tokens wins over max_tokens
        status, ok = await err(body(max_tokens=2, max_completion_tokens=5))
        assert status == 200 and ok["usage"]["completion_tokens"] == 5
        assert set(ok) >= {"id", "usage"} and list(e) == ["error"]

    run(t, max_model_len=512, num_gpu_blocks=64)


def test_queue_overflow_is_503_before_the_stream() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        url = f"{h.url}/v1/chat/completions"
        # one running (max_num_seqs=1), one waiting (limit 1): the third is refused
        slow = body(max_tokens=200, stream=True)
        r1 = await s.post(url, json=slow)
        r2 = await s.post(url, json=slow)
        r3 = await s.post(url, json=slow)
        assert r3.status == 503
        e = await r3.json()
        assert e["error"]["type"] == "Service Unavailable" and e["error"]["code"] == 503
        r1.close()
        r2.close()

    run(t, max_num_seqs=1, max_num_queued_reqs=1)


def test_mid_stream_error_is_one_error_frame_then_done() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(stream=True, max_tokens=10, sim_fail_after_tokens=2)
        r = await s.post(f"{h.url}/v1/chat/completions", json=b, headers={"X-Request-Id": "boom"})
        assert r.status == 200
        raw = await r.read()
        assert raw.endswith(DOC_MIDSTREAM_ERROR)
        rec = h.records["boom"]
        assert rec.finish_reason == "error" and rec.completion_tokens == 2

    run(t)


def test_small_endpoints() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        r = await s.get(f"{h.url}/health")
        assert r.status == 200 and await r.read() == b""
        r = await s.get(f"{h.url}/version")
        assert await r.json() == {"version": "0.33.0"}
        models = await (await s.get(f"{h.url}/v1/models")).json()
        card = models["data"][0]
        assert models["object"] == "list" and card["id"] == MODEL
        assert card["max_model_len"] == 8192 and card["owned_by"] == "vllm"
        assert list(card) == [
            "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
        ]  # fmt: skip
        messages = body()["messages"]
        tok = await (await s.post(f"{h.url}/tokenize", json={"messages": messages})).json()
        assert tok["count"] == count_prompt_tokens(messages) == len(tok["tokens"])
        assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"]

    run(t)


def test_metrics_use_vllm_033_names_and_labels() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        await (await s.post(f"{h.url}/v1/chat/completions", json=body())).read()
        r = await s.get(f"{h.url}/metrics")
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await r.text()
        samples = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                samples.setdefault(smp.name, []).append(smp)
        for name in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:request_time_per_output_token_seconds_bucket",
            "vllm:cache_config_info",
        ):
            assert name in samples, name
        assert samples["vllm:num_requests_running"][0].labels == {
            "engine": "0",
            "model_name": MODEL,
        }
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="my-model"} ' in text
        info = samples["vllm:cache_config_info"][0].labels
        assert info["block_size"] == "16" and info["num_gpu_blocks"] == "4096"
        ok = {
            smp.labels["finished_reason"]: smp.value
            for smp in samples["vllm:request_success_total"]
        }
        assert ok["length"] == 1.0
        assert samples["vllm:generation_tokens_total"][0].value == 3.0
        assert "vllm:gpu_cache_usage_perc" not in text  # gone in 0.33

    run(t)


@pytest.mark.parametrize("stream", [False, True])
def test_official_openai_sdk_parses_the_simulator(stream: bool) -> None:
    from openai import AsyncOpenAI

    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        client = AsyncOpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0)
        messages = body()["messages"]
        if not stream:
            resp = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_completion_tokens=4,
                extra_body={"ignore_eos": True},
            )
            assert resp.choices[0].message.role == "assistant"
            assert resp.usage is not None and resp.usage.completion_tokens == 4
            assert resp.usage.prompt_tokens_details is not None
            assert resp.usage.prompt_tokens_details.cached_tokens == 0
        else:
            got = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage = "", None
            async for chunk in got:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage:
                    usage = chunk.usage
            assert text and usage is not None and usage.completion_tokens == 4
        await client.close()

    run(t)


def test_non_stream_disconnect_aborts_and_bills_nothing_written() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        b = body(max_tokens=500)
        task = asyncio.create_task(
            s.post(f"{h.url}/v1/chat/completions", json=b, headers={"X-Request-Id": "ns"})
        )
        while not (h.engine.running and h.engine.running[0].generated >= 2):
            await asyncio.sleep(0.005)
        task.cancel()  # closes the connection mid-generation
        rec = h.records["ns"]
        for _ in range(200):
            if rec.finish_reason is not None:
                break
            await asyncio.sleep(0.005)
        assert rec.finish_reason == "abort" and rec.completion_tokens == 0
        assert not h.engine.running and h.engine.pool.num_free == h.config.num_gpu_blocks
        r = await s.get(f"{h.url}/sim/requests/chatcmpl-ns")
        assert (await r.json())["finish_reason"] == "abort"

    run(t, step_base_ms=20.0)
