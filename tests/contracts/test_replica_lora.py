"""The replica contract for LoRA adapters, over real HTTP on both engines: real vLLM (the CPU
build, started with LoRA on: tests/conftest.py `vllm_lora_server`) and the simulated replica
(`enable_lora`), each serving a tiny adapter built for the tiny model (tests/vllm/tiny_adapter.py).
What Tollgate relies on: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` with their
answers, the adapters in `/v1/models` with their `parent`, a chat naming an adapter served as
it, `vllm:lora_requests_info` in /metrics once the engine has stepped, and, on an engine
without LoRA, no such endpoints at all. The client side (engine_adapter/lora.py) is run against
the same engines.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.contracts.test_replica import FAST, MODEL, Target, engine, run_on
from tests.vllm.tiny_adapter import build
from tollgate_llm.engine_adapter.lora import (
    AdapterLoadFailed,
    LoraDisabled,
    fetch_adapters,
    load_adapter,
    unload_adapter,
)
from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import start_simulated_replica
from tollgate_llm.engine_adapter.vllm_http import (
    AdapterNotLoaded,
    Served,
    VLLMReplica,
    parse_metrics,
)

__all__ = ["engine"]  # the plain engines' fixture, for the test of an engine without LoRA

MAX_LORAS = 2  # tests/vllm/engine.py LORA_ARGS, and the simulator's below
MAX_LORA_RANK = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two rank-4 adapters with different weights, one of rank 32 (above the engines' 16), and
    a directory with a config and no tensors."""
    root = tmp_path_factory.mktemp("adapters")
    empty = root / "empty"
    build(empty)
    (empty / "adapter_model.safetensors").unlink()
    return {
        "a": build(root / "a", rank=4, seed=1), "b": build(root / "b", rank=4, seed=2),
        "wide": build(root / "wide", rank=32, seed=3), "empty": empty,
    }  # fmt: skip


@pytest.fixture(params=["simulated", "vllm"])
def lora_engine(request: pytest.FixtureRequest) -> Any:
    if request.param == "vllm":
        return request.getfixturevalue("vllm_lora_server")
    return "simulated"


def run_lora(engine: Any, fn: Callable[[Target, aiohttp.ClientSession], Awaitable[None]]) -> None:
    if engine == "simulated":

        async def sim() -> None:
            config = SimConfig(
                model=MODEL, max_model_len=2048, enable_lora=True, max_loras=MAX_LORAS,
                max_lora_rank=MAX_LORA_RANK, **FAST,  # type: ignore[arg-type]
            )  # fmt: skip
            handle = await start_simulated_replica(config)
            try:
                async with aiohttp.ClientSession() as session:
                    await fn(Target("simulated", handle.url, MODEL, 2048, handle), session)
            finally:
                await handle.stop()

        asyncio.run(sim())
        return
    run_on(engine, fn)


def name() -> str:
    """An adapter name no other test used on the session's engine (it keeps what it loaded);
    in Tollgate's engine-name form, tenant/name@version."""
    return f"t{uuid.uuid4().hex[:8]}/support@1"


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        text = await r.text()
        return r.status, (await r.json() if text.startswith("{") else text)


async def chat(s: aiohttp.ClientSession, h: Target, model: str, **kw: Any) -> tuple[int, Any]:
    return await post(s, f"{h.url}/v1/chat/completions", h.body(model=model, **kw))


def test_a_loaded_adapter_is_listed_under_its_parent_and_served_by_name(
    lora_engine: Any, adapters: dict[str, Path]
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        n = name()
        status, text = await post(
            s, f"{h.url}/v1/load_lora_adapter", {"lora_name": n, "lora_path": str(adapters["a"])}
        )
        assert (status, text) == (200, f"Success: LoRA adapter '{n}' added successfully.")
        listed = (await (await s.get(f"{h.url}/v1/models")).json())["data"]
        base, card = listed[0], next(c for c in listed if c["id"] == n)
        assert base["id"] == h.model and base["parent"] is None
        assert card["parent"] == h.model and card["root"] == str(adapters["a"])
        assert list(card) == list(base) and card["max_model_len"] is None
        status, answer = await chat(s, h, n)
        assert status == 200 and answer["model"] == n
        assert answer["usage"]["completion_tokens"] == 3
        async with s.post(f"{h.url}/v1/chat/completions", json=h.body(model=n, stream=True)) as r:
            frames = [line for line in (await r.text()).splitlines() if line.startswith("data: {")]
        assert r.status == 200 and frames and all(f'"model":"{n}"' in f for f in frames)
        if h.sim is not None:
            assert {rec.adapter for rec in h.sim.records.values()} == {n}

    run_lora(lora_engine, t)


def test_loading_twice_is_refused_and_an_unloaded_adapter_is_an_unknown_model(
    lora_engine: Any, adapters: dict[str, Path]
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        n = name()
        status, err = await chat(s, h, n)
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        assert err["error"]["param"] == "model"
        load = {"lora_name": n, "lora_path": str(adapters["a"])}
        assert (await post(s, f"{h.url}/v1/load_lora_adapter", load))[0] == 200
        status, err = await post(s, f"{h.url}/v1/load_lora_adapter", load)
        assert status == 400 and "has already been loaded" in err["error"]["message"]
        status, text = await post(s, f"{h.url}/v1/unload_lora_adapter", {"lora_name": n})
        assert (status, text) == (200, f"Success: LoRA adapter '{n}' removed successfully.")
        status, err = await post(s, f"{h.url}/v1/unload_lora_adapter", {"lora_name": n})
        assert status == 404
        assert err["error"]["message"] == f"The lora adapter '{n}' cannot be found."
        assert (await chat(s, h, n))[0] == 404
        listed = (await (await s.get(f"{h.url}/v1/models")).json())["data"]
        assert n not in {c["id"] for c in listed}

    run_lora(lora_engine, t)


def test_an_adapter_the_engine_cannot_take_is_refused_with_its_reason(
    lora_engine: Any, adapters: dict[str, Path], tmp_path: Path
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        url = f"{h.url}/v1/load_lora_adapter"
        missing = str(tmp_path / "nowhere")
        status, err = await post(s, url, {"lora_name": name(), "lora_path": missing})
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        assert "No adapter found" in err["error"]["message"]
        status, err = await post(s, url, {"lora_name": name(), "lora_path": str(adapters["wide"])})
        wide = f"LoRA rank 32 is greater than max_lora_rank {MAX_LORA_RANK}"
        assert status == 500 and wide in err["error"]["message"]
        status, err = await post(s, url, {"lora_name": name(), "lora_path": str(adapters["empty"])})
        assert status == 500 and "doesn't contain tensors" in err["error"]["message"]

    run_lora(lora_engine, t)


def test_metrics_report_the_slots_once_the_engine_has_stepped(
    lora_engine: Any, adapters: dict[str, Path]
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        n = name()
        load = {"lora_name": n, "lora_path": str(adapters["b"])}
        assert (await post(s, f"{h.url}/v1/load_lora_adapter", load))[0] == 200
        assert (await chat(s, h, n))[0] == 200
        text = await (await s.get(f"{h.url}/metrics")).read()
        assert b"vllm:lora_requests_info{" in text
        assert parse_metrics(text).max_loras == MAX_LORAS

    run_lora(lora_engine, t)


def test_the_gateway_client_loads_lists_and_unloads(
    lora_engine: Any, adapters: dict[str, Path]
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        n = name()
        await load_adapter(s, h.url, n, str(adapters["a"]))
        await load_adapter(s, h.url, n, str(adapters["a"]))  # loaded already: loaded
        assert n in await fetch_adapters(s, h.url, h.model)
        assert n not in await fetch_adapters(s, h.url, "another-base")
        await unload_adapter(s, h.url, n)
        await unload_adapter(s, h.url, n)  # not there: unloaded
        assert n not in await fetch_adapters(s, h.url, h.model)
        with pytest.raises(AdapterLoadFailed) as refused:
            await load_adapter(s, h.url, n, str(adapters["wide"]))
        assert not isinstance(refused.value, LoraDisabled)

    run_lora(lora_engine, t)


def test_a_chat_through_an_adapter_the_engine_lost_fails_as_unavailable_and_says_so(
    lora_engine: Any, adapters: dict[str, Path]
) -> None:
    """A replica restarted (or another router unloaded the adapter) between two health checks:
    the engine's 404 becomes a replica-unavailable error (a 503 to retry, the engine name never
    shown), and the router is told to forget it there; once loaded, the same call is served."""

    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        n, lost = name(), []
        replica = VLLMReplica("r0", h.url, h.model)
        served = Served(n, "support", lambda: lost.append(n))
        exchange = await replica.open_chat(h.body(), request_id="req-lost", cache_salt="s",
                                           adapter=served)  # fmt: skip
        with pytest.raises(AdapterNotLoaded):
            await exchange.run(lambda chunk: None)
        assert lost == [n]
        await load_adapter(s, h.url, n, str(adapters["a"]))
        exchange = await replica.open_chat(h.body(), request_id="req-found", cache_salt="s",
                                           adapter=served)  # fmt: skip
        models = []
        await exchange.run(lambda chunk: models.append(chunk.get("model")))
        assert models and set(models) == {"support"} and lost == [n]
        replica.close()

    run_lora(lora_engine, t)


def test_an_engine_without_lora_has_no_adapter_endpoints(
    engine: Any, adapters: dict[str, Path]
) -> None:
    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        load = {"lora_name": name(), "lora_path": str(adapters["a"])}
        assert await post(s, f"{h.url}/v1/load_lora_adapter", load) == (
            404, {"detail": "Not Found"},
        )  # fmt: skip
        with pytest.raises(LoraDisabled):
            await load_adapter(s, h.url, name(), str(adapters["a"]))
        assert b"vllm:lora_requests_info" not in await (await s.get(f"{h.url}/metrics")).read()

    run_on(engine, t)


def test_on_real_vllm_the_adapter_changes_what_the_model_says(
    vllm_lora_server: Any, adapters: dict[str, Path]
) -> None:
    """The weights are applied, not only the name accepted: greedy decoding through the
    adapter differs from the base model's, and two adapters differ from each other."""

    async def t(h: Target, s: aiohttp.ClientSession) -> None:
        names = {key: name() for key in ("a", "b")}
        for key, n in names.items():
            load = {"lora_name": n, "lora_path": str(adapters[key])}
            assert (await post(s, f"{h.url}/v1/load_lora_adapter", load))[0] == 200
        said = {}
        for model in (h.model, *names.values()):
            status, answer = await chat(s, h, model, temperature=0, max_tokens=12)
            assert status == 200
            said[model] = answer["choices"][0]["message"]["content"]
        assert len(set(said.values())) == 3, said

    run_on(vllm_lora_server, t)
