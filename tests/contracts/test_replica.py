"""The replica contract: what the engine adapter relies on, checked over real HTTP on both engines
the gateway meets: the simulated replica and real vLLM (the CPU build serving the tiny model,
tests/vllm/engine.py). Shapes are compared with the examples in vllm-protocol.md (key order and
types; ids, times and values may differ). Tests that need a simulator knob (a small context, one
sequence, fault injection) or its internals run on the simulator only; where vLLM 0.32 (the CPU
build) differs from the 0.33 examples, `for_engine` says so, and engine_adapter/README.md lists it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import (
    SimulatedReplicaHandle,
    start_simulated_replica,
)
from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens

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


# Keys vLLM 0.33 added that the 0.32 CPU build does not send (read from its responses): the
# examples are 0.33's, so on the real engine they are compared without these.
NOT_IN_032 = {
    "choice": ("weight_versions",),  # non-stream choices and stream finish chunks
    "chunk": ("kv_transfer_params",),  # stream content and finish chunks
}


def for_engine(doc: bytes, engine: str, *, chunk: bool = False) -> Any:
    """The shape of a documented example as this engine sends it."""
    example = orjson.loads(doc)
    if engine == "vllm":
        for choice in example.get("choices", ()):
            for key in NOT_IN_032["choice"]:
                choice.pop(key, None)
        if chunk and example.get("choices"):
            for key in NOT_IN_032["chunk"]:
                example.pop(key, None)
    return shape(example)


@dataclass
class Target:
    """The replica under test: its URL and model, and the simulator's handle when it is one."""

    engine: str
    url: str
    model: str
    max_model_len: int
    sim: SimulatedReplicaHandle | None = None

    def body(self, **kw: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello to the world, please."}],
            "max_tokens": 3,
            "ignore_eos": True,
            **kw,
        }

    async def prompt_tokens(self, s: aiohttp.ClientSession, messages: list[Any]) -> int:
        """The engine's own count for a chat (its /tokenize, template applied)."""
        r = await s.post(f"{self.url}/tokenize", json={"model": self.model, "messages": messages})
        return int((await r.json())["count"])


@pytest.fixture(params=["simulated", "vllm"])
def engine(request: pytest.FixtureRequest) -> Any:
    """The simulated replica ("simulated"), or the session's `vllm serve`."""
    if request.param == "vllm":
        return request.getfixturevalue("vllm_server")
    return "simulated"


def run_on(engine: Any, fn: Callable[[Target, aiohttp.ClientSession], Awaitable[None]]) -> None:
    if engine == "simulated":
        # The same context as the session's vLLM (tests/vllm/engine.py), so both run alike.
        run(
            lambda h, s: fn(Target("simulated", h.url, MODEL, h.config.max_model_len, h), s),
            max_model_len=2048,
        )
        return

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await fn(Target("vllm", engine.url, engine.model, engine.max_model_len), session)

    asyncio.run(main())


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


def test_non_stream_body_matches_vllm_key_for_key(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        b = h.body()
        r = await s.post(f"{h.url}/v1/chat/completions", json=b, headers={"X-Request-Id": "x1"})
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        raw = await r.read()
        assert_compact(raw)
        got = orjson.loads(raw)
        assert shape(got) == for_engine(DOC_NON_STREAM, h.engine)
        assert got["id"] == "chatcmpl-x1"
        assert got["model"] == h.model
        usage = got["usage"]
        assert usage["completion_tokens"] == 3 and got["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] == await h.prompt_tokens(s, b["messages"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + 3
        assert usage["prompt_tokens_details"]["cached_tokens"] % 16 == 0

    run_on(engine, t)


def test_stream_without_options_matches_case_a(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        r = await s.post(f"{h.url}/v1/chat/completions", json=h.body(stream=True))
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        frames = await frames_of(r)
        for f in frames:
            assert_compact(f)
        chunks = [orjson.loads(f) for f in frames]
        assert shape(chunks[0]) == for_engine(DOC_STREAM_A[0], h.engine, chunk=True)
        for c in chunks[1:-1]:
            assert shape(c) == for_engine(DOC_STREAM_A[1], h.engine, chunk=True)
        assert shape(chunks[-1]) == for_engine(DOC_STREAM_A[2], h.engine, chunk=True)
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
        # (vLLM may send an empty delta while it holds back the bytes of a partial character)
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"

    run_on(engine, t)


def test_include_usage_adds_one_usage_chunk_with_prompt_details(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        b = h.body(stream=True, stream_options={"include_usage": True})
        r = await s.post(f"{h.url}/v1/chat/completions", json=b)
        chunks = [orjson.loads(f) for f in await frames_of(r)]
        doc = orjson.loads(DOC_USAGE_CHUNK)
        assert shape(chunks[-1]) == shape(doc)
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert chunks[-1]["usage"]["prompt_tokens"] == await h.prompt_tokens(s, b["messages"])
        # with include_usage the fingerprint moves from the finish chunk to the usage chunk
        assert "system_fingerprint" not in chunks[-2]
        assert all("usage" not in c for c in chunks[:-1])

    run_on(engine, t)


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


def test_continuous_usage_on_every_chunk_including_the_role_chunk(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        b = h.body(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
        r = await s.post(f"{h.url}/v1/chat/completions", json=b)
        chunks = [orjson.loads(f) for f in await frames_of(r)]
        doc_usage = shape(orjson.loads(DOC_CONTINUOUS_USAGE))
        prompt = await h.prompt_tokens(s, b["messages"])
        top = ["id", "object", "created", "model", "choices", "usage"]
        assert list(chunks[0]) == [*top, "prompt_token_ids", "prompt_text"]
        for c in chunks[:-1]:
            assert shape(c["usage"]) == doc_usage
            assert c["usage"]["prompt_tokens"] == prompt
        tail = [] if h.engine == "vllm" else ["kv_transfer_params"]  # 0.32 has no such key
        for c in chunks[1:-1]:
            assert [k for k in c if k != "system_fingerprint"] == [*top, *tail]
        assert chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk
        counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == 3
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert "prompt_tokens_details" in chunks[-1]["usage"]

    run_on(engine, t)


def test_continuous_usage_without_include_usage_does_nothing(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        b = h.body(stream=True, stream_options={"continuous_usage_stats": True})
        chunks = [
            orjson.loads(f)
            for f in await frames_of(await s.post(f"{h.url}/v1/chat/completions", json=b))
        ]
        assert all("usage" not in c for c in chunks)

    run_on(engine, t)


def test_error_bodies_on_both_engines(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        url = f"{h.url}/v1/chat/completions"

        async def err(b: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
            r = await s.post(url, json=b, **kw)
            raw = await r.read()
            assert_compact(raw)
            return r.status, orjson.loads(raw)

        status, e = await err(h.body(model="foo"))
        assert status == 404
        assert orjson.dumps(e) == DOC_404.replace(b"my-model", h.model.encode())
        status, e = await err(h.body(stream_options={"include_usage": True}))
        assert status == 400 and e["error"]["type"] == "BadRequestError"
        assert e["error"]["param"] == "stream_options" and e["error"]["code"] == 400
        assert e["error"]["message"].startswith("Stream options can only be defined when")
        for salt in ("", "a" * 129, "a@b", "a/b", "a\\b", "a\x00b"):
            status, e = await err(h.body(cache_salt=salt))
            assert status == 400 and e["error"]["param"] == "cache_salt", salt
        status, _ = await err(h.body(cache_salt="a" * 128))
        assert status == 200
        long = [{"role": "user", "content": "word " * (h.max_model_len + 10)}]
        status, e = await err(h.body(messages=long))
        assert status == 400 and e["error"]["type"] == "BadRequestError"
        assert e["error"]["param"] == "input_tokens"
        assert e["error"]["message"].startswith(
            f"This model's maximum context length is {h.max_model_len} tokens. However, your "
            "prompt contains "
        )
        # More output than the whole context can ever hold.
        status, e = await err(h.body(max_tokens=h.max_model_len + 1))
        assert status == 400 and e["error"]["param"] == "max_tokens"
        # Less than the context but more than it has left after the prompt: generated up to the
        # end of the context (vLLM 0.32), not refused.
        status, ok = await err(h.body(max_tokens=h.max_model_len - 2))
        assert status == 200
        room = h.max_model_len - ok["usage"]["prompt_tokens"]
        assert ok["usage"]["completion_tokens"] == room
        assert ok["choices"][0]["finish_reason"] == "length"
        status, e = await err({"model": h.model})
        assert status == 400 and e["error"]["type"] == "Bad Request"
        assert e["error"]["param"] == "body.messages"
        # unknown fields are accepted and ignored, as vLLM's extra="allow"
        status, _ = await err(h.body(frobnicate={"x": 1}, user="u"))
        assert status == 200
        # max_completion_tokens wins over max_tokens
        status, ok = await err(h.body(max_tokens=2, max_completion_tokens=5))
        assert status == 200 and ok["usage"]["completion_tokens"] == 5
        assert set(ok) >= {"id", "usage"} and list(e) == ["error"]

    run_on(engine, t)


def test_simulator_context_limit_and_n() -> None:
    async def t(h: SimulatedReplicaHandle, s: aiohttp.ClientSession) -> None:
        url = f"{h.url}/v1/chat/completions"
        r = await s.post(url, json=body(messages=[{"role": "user", "content": "word " * 600}]))
        e = await r.json()
        assert r.status == 400 and e["error"]["type"] == "BadRequestError"
        assert e["error"]["message"].startswith(
            "This model's maximum context length is 512 tokens. However, your prompt contains "
        )
        # A known difference: vLLM serves n > 1, the simulator refuses it (the gateway never
        # sends it: api/services/chat_request.py accepts n=1 only).
        r = await s.post(url, json=body(n=2))
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"

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


def test_small_endpoints(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        r = await s.get(f"{h.url}/health")
        assert r.status == 200 and await r.read() == b""
        r = await s.get(f"{h.url}/version")
        # The simulator speaks 0.33; the CPU build tested is 0.32.
        assert await r.json() == {"version": "0.33.0" if h.engine == "simulated" else "0.32.0"}
        models = await (await s.get(f"{h.url}/v1/models")).json()
        card = models["data"][0]
        assert models["object"] == "list" and card["id"] == h.model
        assert card["max_model_len"] == h.max_model_len and card["owned_by"] == "vllm"
        assert list(card) == [
            "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
        ]  # fmt: skip
        messages = h.body()["messages"]
        tok = await (await s.post(f"{h.url}/tokenize", json={"messages": messages})).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == h.max_model_len
        assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"]
        if h.engine == "simulated":
            assert tok["count"] == count_prompt_tokens(messages)

    run_on(engine, t)


def metric_samples(text: str) -> dict[str, list[Any]]:
    samples: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            samples.setdefault(smp.name, []).append(smp)
    return samples


def test_metrics_use_vllm_names_and_labels(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        before = metric_samples(await (await s.get(f"{h.url}/metrics")).text())
        await (await s.post(f"{h.url}/v1/chat/completions", json=h.body())).read()
        r = await s.get(f"{h.url}/metrics")
        # Prometheus text format; vLLM 0.32's prometheus_client labels it version=1.0.0.
        assert r.headers["Content-Type"] == (
            "text/plain; version=0.0.4; charset=utf-8"
            if h.engine == "simulated"
            else "text/plain; version=1.0.0; charset=utf-8"
        )
        text = await r.text()
        samples = metric_samples(text)
        for name in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total",
            "vllm:prompt_tokens_cached_total",
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
            "model_name": h.model,
        }
        assert f'vllm:kv_cache_usage_perc{{engine="0",model_name="{h.model}"}} ' in text
        info = samples["vllm:cache_config_info"][0].labels
        # Paged KV: 16-token blocks on the GPU (and the simulator), 128 on vLLM's CPU backend.
        assert info["block_size"] == ("16" if h.engine == "simulated" else "128")
        assert int(info["num_gpu_blocks"]) > 0

        def by_reason(samples: dict[str, list[Any]]) -> dict[str, float]:
            return {
                smp.labels["finished_reason"]: smp.value
                for smp in samples.get("vllm:request_success_total", ())
            }

        assert by_reason(samples)["length"] - by_reason(before).get("length", 0.0) == 1.0

        def generated(samples: dict[str, list[Any]]) -> float:
            return sum(smp.value for smp in samples.get("vllm:generation_tokens_total", ()))

        assert generated(samples) - generated(before) == 3.0
        assert "vllm:gpu_cache_usage_perc" not in text  # gone in 0.33

    run_on(engine, t)


@pytest.mark.parametrize("stream", [False, True])
def test_official_openai_sdk_parses_the_engine(engine: Any, stream: bool) -> None:
    from openai import AsyncOpenAI

    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        client = AsyncOpenAI(base_url=f"{h.url}/v1", api_key="unused", max_retries=0)
        messages = h.body()["messages"]
        if not stream:
            resp = await client.chat.completions.create(
                model=h.model,
                messages=messages,
                max_completion_tokens=4,
                extra_body={"ignore_eos": True},
            )
            assert resp.choices[0].message.role == "assistant"
            assert resp.choices[0].message.refusal is None
            assert resp.usage is not None and resp.usage.completion_tokens == 4
            assert resp.usage.prompt_tokens_details is not None
            assert resp.usage.prompt_tokens_details.cached_tokens == 0
        else:
            got = await client.chat.completions.create(
                model=h.model,
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

    run_on(engine, t)


async def until(what: str, check: Callable[[], Awaitable[bool]], limit_s: float = 120) -> None:
    """Poll `check` until it holds. The limit only turns a hang into a failure that says what
    never happened; it asserts nothing about speed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"{what}: not seen in {limit_s:.0f} s")
        await asyncio.sleep(0.02)


def test_a_client_that_leaves_aborts_the_request(engine: Any) -> None:
    """Non-streamed and streamed: the engine aborts a request whose client closed the connection
    mid-generation and frees it (its running gauge back to 0). The simulator counts the abort in
    /metrics; vLLM 0.32 does not (its finished_reason="abort" series stays 0) but logs it."""

    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        async def scrape() -> dict[str, list[Any]]:
            return metric_samples(await (await s.get(f"{h.url}/metrics")).text())

        async def running() -> float:
            return float((await scrape())["vllm:num_requests_running"][0].value)

        def finished(samples: dict[str, list[Any]], reason: str) -> float:
            return sum(
                smp.value
                for smp in samples.get("vllm:request_success_total", ())
                if smp.labels["finished_reason"] == reason
            )


        async def leave(stream: bool, rid: str) -> None:
            b = h.body(max_tokens=h.max_model_len - 100, stream=stream)
            headers = {"X-Request-Id": rid}
            if stream:
                r = await s.post(f"{h.url}/v1/chat/completions", json=b, headers=headers)
                assert r.status == 200
                await r.content.readany()  # the first token is out
                r.close()
                return
            task = asyncio.create_task(
                s.post(f"{h.url}/v1/chat/completions", json=b, headers=headers)
            )

            async def started() -> bool:
                # The engine's own word that it took the request: the simulator's record,
                # vLLM's log (its /metrics can take seconds to answer on busy cores).
                if task.done():
                    return True  # it ended first (then the engine counts it finished)
                if h.sim is not None:
                    return rid in h.sim.records
                return f"Added request chatcmpl-{rid}-" in engine.log_text()

            await until("the engine taking the request", started)
            task.cancel()  # closes the connection mid-generation

        async def freed() -> bool:
            return await running() == 0

        # The tiny model on vLLM's CPU build can outrun the client (its API server stalls for
        # seconds on two cores, then flushes a whole answer): a request the engine finished
        # before the client left has nothing to abort; that try is repeated (at most 5).
        for stream in (False, True):
            for n in range(5):
                rid = f"leave-{stream}-{n}-{id(s)}"
                before = await scrape()
                await leave(stream, rid)
                await until("the engine freeing the request", freed)
                after = await scrape()
                if finished(after, "length") > finished(before, "length"):
                    continue  # finished before the client left
                if h.engine == "simulated":
                    assert finished(after, "abort") - finished(before, "abort") == 1
                else:
                    assert engine.aborted(rid), engine.log_tail()
                break
            else:
                tail = engine.log_tail() if h.engine == "vllm" else ""
                pytest.fail(f"the engine finished every try before its client left ({stream=})"
                            f"\n{tail}")  # fmt: skip

    run_on(engine, t)


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


def test_same_salt_hits_the_prefix_cache_and_another_salt_never_does(engine: Any) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        # Long enough for whole blocks on either engine (128-token blocks on vLLM's CPU).
        system = "You are a careful assistant for the billing ledger. " * 60
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]

        async def cached(salt: str) -> int:
            r = await s.post(
                f"{h.url}/v1/chat/completions",
                json=h.body(messages=messages, cache_salt=salt, max_tokens=1),
            )
            return int((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

        async def cached_total() -> float:
            text = await (await s.get(f"{h.url}/metrics")).text()
            samples = metric_samples(text)["vllm:prompt_tokens_cached_total"]
            return sum(smp.value for smp in samples)

        before = await cached_total()
        first = await cached("tenant-a")
        again = await cached("tenant-a")
        other = await cached("tenant-b")
        assert first == 0 and again > 0 and other == 0
        # The counter billing is reconciled against moves by what the responses reported.
        assert await cached_total() - before == again

    run_on(engine, t)
