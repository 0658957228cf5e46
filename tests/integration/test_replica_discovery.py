"""The adapter configured from a replica's /v1/models, on both engines: the engine's own name for
the model is sent and the gateway's version answered, and `max_tokens` always fits what the
context has left after the prompt (none given, or more than the whole context)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tollgate_llm.engine_adapter.discovery import ReplicaMismatch, discover
from tollgate_llm.engine_adapter.estimators import WordTokenEstimator
from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import start_simulated_replica
from tollgate_llm.engine_adapter.tokenizers import ChatTemplateEstimator
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica

GATEWAY_NAME = "house-model-2026-05"  # what Tollgate calls the model, not the engine's name
FAST = {"step_base_ms": 1.0, "per_seq_ms": 0.05, "prefill_ms_per_1k_tokens": 1.0}


@pytest.fixture(params=["simulated", "vllm"])
def engine(request: pytest.FixtureRequest) -> Any:
    if request.param == "vllm":
        return request.getfixturevalue("vllm_server")
    return "simulated"


def run_on(engine: Any, fn: Callable[[VLLMReplica, Any], Awaitable[None]]) -> None:
    async def main() -> None:
        handle = None
        if engine == "simulated":
            handle = await start_simulated_replica(
                SimConfig(model="sim-engine-name", max_model_len=512, num_gpu_blocks=64, **FAST)
            )
        url = handle.url if handle else engine.url
        replica = VLLMReplica("r0", url, GATEWAY_NAME)
        try:
            async with aiohttp.ClientSession() as session:
                served = await discover(session, [replica], simulated=handle is not None)
            await fn(replica, served[GATEWAY_NAME])
        finally:
            replica.close()
            if handle is not None:
                await handle.stop()

    asyncio.run(main())


async def chat(replica: VLLMReplica, body: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    exchange = await replica.open_chat(body, request_id=rid, cache_salt="salt-1")
    return [chunk async for chunk in exchange]


def near_full_prompt(replica: VLLMReplica, room: int) -> list[dict[str, Any]]:
    """A chat whose prompt leaves about `room` tokens of the context (by the replica's own
    estimator, which equals the engine's count: tests/integration/test_estimator_vllm.py)."""
    assert replica.estimator is not None and replica.max_model_len is not None
    words = 1
    while True:
        messages = [{"role": "user", "content": "ledger " * words}]
        if replica.estimator.prompt_tokens(messages) >= replica.max_model_len - room:
            return messages
        words += max(1, (replica.max_model_len - room - replica.estimator.prompt_tokens(messages))
                     // 3)  # fmt: skip


def test_discovery_reads_the_engine_name_context_and_tokenizer(engine: Any) -> None:
    async def t(replica: VLLMReplica, served: Any) -> None:
        if engine == "simulated":
            assert replica.served_model == "sim-engine-name" and replica.max_model_len == 512
            assert isinstance(served.estimator, WordTokenEstimator)
        else:
            assert replica.served_model == engine.model
            assert replica.max_model_len == engine.max_model_len
            assert isinstance(served.estimator, ChatTemplateEstimator)
            assert served.tokenizer_dir == str(engine.model_dir)  # the root vLLM reports

    run_on(engine, t)


@pytest.mark.parametrize("max_tokens", [None, "context+100"])
def test_output_limit_fits_what_the_context_has_left(engine: Any, max_tokens: Any) -> None:
    async def t(replica: VLLMReplica, served: Any) -> None:
        assert replica.max_model_len is not None
        messages = near_full_prompt(replica, room=12)
        body: dict[str, Any] = {"messages": messages, "ignore_eos": True}
        if max_tokens is not None:
            body["max_tokens"] = replica.max_model_len + 100
        chunks = await chat(replica, body, f"fit-{max_tokens}")
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == replica.estimator.prompt_tokens(messages)  # type: ignore[union-attr]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == replica.max_model_len
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finish[-1] == "length"
        assert {c["model"] for c in chunks} == {GATEWAY_NAME}

    run_on(engine, t)


def test_a_replica_serving_several_other_models_is_a_configuration_error() -> None:
    from tollgate_llm.engine_adapter.discovery import pick_card
    from tollgate_llm.engine_adapter.vllm_http import ModelCard

    replica = VLLMReplica("r9", "http://127.0.0.1:1", "wanted-2026-05")
    cards = [ModelCard("a", 10, None), ModelCard("b", 10, None)]
    with pytest.raises(ReplicaMismatch, match="--served-model-name wanted-2026-05"):
        pick_card(replica, cards)
    assert pick_card(replica, [*cards, ModelCard("wanted-2026-05", 8, None)]).id == (
        "wanted-2026-05"
    )
