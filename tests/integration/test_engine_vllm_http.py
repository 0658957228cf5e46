"""VLLMReplica.stream_chat against the simulated replica over real HTTP: engine-reported usage,
cache_salt isolation, abort on close, preemption, and TPOT under batching."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import (
    SimulatedReplicaHandle,
    start_simulated_replica,
)
from tollgate_llm.engine_adapter.vllm_http import (
    ReplicaHTTPError,
    ReplicaStreamBroken,
    ReplicaUnavailable,
    VLLMReplica,
    fetch_metrics,
    make_session,
)

MODEL = "sim-model"
FAST = {"step_base_ms": 1.0, "per_seq_ms": 0.05, "prefill_ms_per_1k_tokens": 1.0}


def run(
    fn: Callable[[SimulatedReplicaHandle, VLLMReplica, aiohttp.ClientSession], Awaitable[None]],
    **cfg: Any,
) -> None:
    async def main() -> None:
        handle = await start_simulated_replica(SimConfig(model=MODEL, **{**FAST, **cfg}))
        try:
            async with make_session() as session:
                replica = VLLMReplica("r1", handle.url, MODEL)
                try:
                    await fn(handle, replica, session)
                finally:
                    replica.close()
        finally:
            await handle.stop()

    asyncio.run(main())


def chat(text: str = "Tell me a story about a fox.", **kw: Any) -> dict[str, Any]:
    return {"model": "public-name", "messages": [{"role": "user", "content": text}], **kw}


async def collect(replica: VLLMReplica, body: dict[str, Any], rid: str, salt: str = "t1"):
    return [c async for c in replica.stream_chat(body, request_id=rid, cache_salt=salt)]


async def until(pred: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_every_chunk_carries_cumulative_engine_usage() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, _: aiohttp.ClientSession) -> None:
        # The client asked for no usage and a salt of its own: both are overridden.
        body = chat(max_tokens=7, ignore_eos=True, stream=False, cache_salt="evil")
        body["stream_options"] = {"include_usage": False}
        chunks = await collect(replica, body, "req-usage")
        assert all("usage" in c for c in chunks)
        assert {c["id"] for c in chunks} == {"chatcmpl-req-usage"}
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 7
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts[0] == 0 and counts == sorted(counts)
        rec = h.records["req-usage"]
        assert (rec.prompt_tokens, rec.completion_tokens, rec.finish_reason) == (
            final["usage"]["prompt_tokens"],
            7,
            "length",
        )

    run(t)


def test_cache_salt_isolates_prefix_cache_hits() -> None:
    long_prompt = " ".join(f"word{i}" for i in range(300))

    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, _: aiohttp.ClientSession) -> None:
        body = chat(long_prompt, max_tokens=2)

        async def cached(rid: str, salt: str) -> int:
            chunks = await collect(replica, body, rid, salt)
            got = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert got == h.records[rid].cached_tokens and got % 16 == 0
            return got

        assert await cached("a1", "tenant-a") == 0
        hit = await cached("a2", "tenant-a")
        prompt = h.records["a2"].prompt_tokens
        assert hit > 0 and hit == (prompt - 1) // 16 * 16  # all full blocks but the last token
        assert await cached("b1", "tenant-b") == 0  # another tenant never hits a's blocks
        assert await cached("b2", "tenant-b") == hit

    run(t)


def test_aclose_aborts_the_request_and_frees_kv() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        gen = replica.stream_chat(
            chat(max_tokens=500, ignore_eos=True), request_id="gone", cache_salt="t"
        )
        last = None
        async for chunk in gen:
            last = chunk["usage"]["completion_tokens"]
            if last >= 4:
                break
        await gen.aclose()
        rec = h.records["gone"]
        await until(lambda: rec.finish_reason is not None)
        # Steps are 40 ms apart, so the abort (ms) lands before the engine writes another token.
        assert rec.finish_reason == "abort"
        assert rec.completion_tokens == last
        m = await fetch_metrics(s, h.url)
        assert m.running == 0 and m.waiting == 0 and m.kv_cache_usage == 0.0
        assert h.engine.pool.num_free == h.config.num_gpu_blocks

    run(t, step_base_ms=40.0)


def test_cancelling_the_consumer_task_aborts_too() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        seen: list[int] = []

        async def consume() -> None:
            body = chat(max_tokens=500, ignore_eos=True)
            async for chunk in replica.stream_chat(body, request_id="cx", cache_salt="t"):
                seen.append(chunk["usage"]["completion_tokens"])

        task = asyncio.create_task(consume())
        await until(lambda: bool(seen) and seen[-1] >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rec = h.records["cx"]
        await until(lambda: rec.finish_reason is not None)
        assert rec.finish_reason == "abort" and rec.completion_tokens == seen[-1]
        assert (await fetch_metrics(s, h.url)).running == 0

    run(t, step_base_ms=40.0)


def test_preemption_under_scarce_blocks_keeps_counts_exact() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        async def one(i: int) -> dict[str, Any]:
            body = chat(f"request number {i} " + "pad " * 40, max_tokens=150, ignore_eos=True)
            chunks = await collect(replica, body, f"p{i}")
            return chunks[-1]["usage"]

        usages = await asyncio.gather(*(one(i) for i in range(8)))
        m = await fetch_metrics(s, h.url)
        assert m.preemptions > 0
        assert sum(h.records[f"p{i}"].preemptions for i in range(8)) == m.preemptions
        for i, usage in enumerate(usages):
            rec = h.records[f"p{i}"]
            assert rec.finish_reason == "length"
            assert usage["completion_tokens"] == rec.completion_tokens == 150
            assert rec.generated_tokens == 150  # recompute re-prefills, it does not re-emit
            assert usage["prompt_tokens"] == rec.prompt_tokens
        assert m.running == 0 and h.engine.pool.num_free == 40

    # 8 requests x ~13 blocks each against 40 blocks: the engine must preempt and recompute.
    run(t, num_gpu_blocks=40, max_model_len=640, max_num_batched_tokens=256)


def test_tpot_grows_with_batch_size() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, _: aiohttp.ClientSession) -> None:
        async def tpot(rid: str) -> float:
            stamps = []
            body = chat(max_tokens=20, ignore_eos=True)
            async for c in replica.stream_chat(body, request_id=rid, cache_salt=rid):
                if c["choices"] and c["choices"][0]["delta"].get("content"):
                    stamps.append((time.perf_counter(), c["usage"]["completion_tokens"]))
            (t0, n0), (t1, n1) = stamps[0], stamps[-1]
            return (t1 - t0) / (n1 - n0)

        alone = await tpot("solo")
        batch = await asyncio.gather(*(tpot(f"b{i}") for i in range(16)))
        ratio = (sum(batch) / len(batch)) / alone
        # step = 1 ms + 1 ms x running: 2 ms alone vs 17 ms for 16 (ratio 8.5 in the model)
        assert ratio > 3.0, ratio

    run(t, step_base_ms=1.0, per_seq_ms=1.0)


def test_errors_before_the_stream_and_broken_streams() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        wrong = VLLMReplica("r2", h.url, "no-such-model")
        with pytest.raises(ReplicaHTTPError) as e:
            await collect(wrong, chat(), "x")
        assert e.value.status == 404 and e.value.body["error"]["type"] == "NotFoundError"

        with pytest.raises(ReplicaHTTPError) as e:
            await collect(replica, chat(max_tokens=0), "x")
        assert e.value.status == 400 and e.value.body["error"]["param"] == "max_tokens"

        dead = VLLMReplica("r3", "http://127.0.0.1:9", MODEL)
        with pytest.raises(ReplicaUnavailable):
            await collect(dead, chat(), "x")

        with pytest.raises(ReplicaStreamBroken) as e:
            await collect(replica, chat(max_tokens=50, sim_drop_after_tokens=5), "drop")
        assert e.value.last_usage is not None
        assert e.value.last_usage["completion_tokens"] == h.records["drop"].completion_tokens >= 5

        # an in-stream error object is yielded as a chunk, then the stream ends at [DONE]
        chunks = await collect(replica, chat(max_tokens=50, sim_fail_after_tokens=3), "err")
        assert chunks[-1] == {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }

    run(t)


def test_connection_is_reused_after_done() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        for i in range(5):
            await collect(replica, chat(max_tokens=2), f"k{i}")
        assert replica.idle_connections == 1  # one kept-alive connection, reused

    run(t)


def test_fast_metrics_parser_agrees_with_prometheus_client() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tollgate_llm.engine_adapter.vllm_http import parse_metrics

    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, s: aiohttp.ClientSession) -> None:
        gen = replica.stream_chat(
            chat(max_tokens=500, ignore_eos=True), request_id="m", cache_salt="t"
        )
        await gen.__anext__()
        await gen.__anext__()
        await asyncio.gather(*(collect(replica, chat(max_tokens=5), f"q{i}") for i in range(5)))
        text = await (await s.get(f"{h.url}/metrics")).read()
        await gen.aclose()
        ref: dict[str, Any] = {}
        buckets = []
        for fam in text_string_to_metric_families(text.decode()):
            for smp in fam.samples:
                if smp.name == "vllm:request_time_per_output_token_seconds_bucket":
                    buckets.append((float(smp.labels["le"]), int(smp.value)))
                elif smp.name == "vllm:cache_config_info":
                    ref["blocks"] = int(smp.labels["num_gpu_blocks"])
                else:
                    ref[smp.name] = smp.value
        m = parse_metrics(text)
        assert m.running == ref["vllm:num_requests_running"] == 1
        assert m.waiting == ref["vllm:num_requests_waiting"]
        assert m.kv_cache_usage == ref["vllm:kv_cache_usage_perc"] > 0
        assert m.preemptions == ref["vllm:num_preemptions_total"]
        assert m.num_gpu_blocks == ref["blocks"] and m.block_size == 16
        assert list(m.tpot_buckets) == sorted(buckets) and m.tpot_count == 5
        assert m.kv_capacity_tokens == ref["blocks"] * 16

    run(t)


def test_priority_policy_admits_lower_values_first() -> None:
    async def t(h: SimulatedReplicaHandle, replica: VLLMReplica, _: aiohttp.ClientSession) -> None:
        done: list[str] = []

        async def one(rid: str, prio: int, tokens: int) -> None:
            await collect(replica, chat(max_tokens=tokens, ignore_eos=True, priority=prio), rid)
            done.append(rid)

        first = asyncio.create_task(one("busy", 0, 80))
        await until(lambda: "busy" in h.records)
        late = [asyncio.create_task(one(f"p{p}", p, 2)) for p in (9, 5, 0)]
        await asyncio.gather(first, *late)
        assert done == ["busy", "p0", "p5", "p9"]

    run(t, max_num_seqs=1, scheduling_policy="priority")
