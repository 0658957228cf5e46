"""Issue 30, item 1, in front of real vLLM (the CPU build, started with `--enable-lora --max-loras
2`: tests/conftest.py `vllm_lora_server`): a tenant's adapter for the tiny model, built by
tests/vllm/tiny_adapter.py, registered with `tollgate adapters register`, loaded by the gateway
through vLLM's `/v1/load_lora_adapter` on the first request that needs it, served by name with
the official openai SDK (its greedy answer is not the base model's: the weights are applied),
billed with the adapter in the ledger at vLLM's own token counts; another tenant gets the
unknown model's 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import EngineReplica, Server, auth, poll
from tests.vllm.tiny_adapter import build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-llama-2026-05"


@pytest.fixture(scope="module")
def gateway(vllm_lora_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("real-vllm-lora")
    server = Server(tmp, [EngineReplica(MODEL, vllm_lora_server.url)])  # type: ignore[list-item]
    server.data_dir.mkdir(parents=True)
    server.cli("models", "register", "--model", MODEL, "--hf-config",
               str(vllm_lora_server.model_dir / "config.json"))  # fmt: skip
    try:
        yield server.start()
    finally:
        server.stop()


def test_a_tenants_adapter_is_loaded_served_and_billed_on_real_vllm(
    gateway: Server, vllm_lora_server: Any, tmp_path: Path
) -> None:
    server = gateway
    tenants = server.new_tenants({"acme": {}, "bolt": {}})
    acme, bolt = tenants["acme"], tenants["bolt"]
    path = build(tmp_path / "support", rank=8, seed=5)
    server.cli("adapters", "register", "--tenant", acme.name, "--name", "support",
               "--base", MODEL, "--path", str(path))  # fmt: skip
    client = OpenAI(base_url=f"{server.base}/v1", api_key=acme.secret, max_retries=0)
    messages: Any = [{"role": "user", "content": "hello world the model"}]

    def ask(model: str) -> Any:
        return client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=12, temperature=0
        )

    def served() -> Any:
        try:
            return ask("support")
        except openai.NotFoundError:
            return None  # the edge has not followed the registration yet

    raw = poll("the adapter to be served", served, timeout=60)
    answer = raw.parse()
    assert answer.model == "support"
    engine_name = f"{acme.name}/support@1"
    listed = httpx.get(f"{vllm_lora_server.url}/v1/models", timeout=10).json()["data"]
    assert {(c["id"], c["parent"]) for c in listed} >= {(engine_name, MODEL)}
    base = ask(MODEL).parse()
    assert answer.choices[0].message.content != base.choices[0].message.content

    rid = raw.headers["x-request-id"]
    entry = server.wait_billed(rid, timeout=30)
    assert entry["adapter"] == "support" and entry["model"] == MODEL
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (
        answer.usage.prompt_tokens, answer.usage.completion_tokens,
    )  # fmt: skip

    theirs = httpx.post(
        f"{server.base}/v1/chat/completions", headers=auth(bolt.secret), timeout=30,
        json={"model": "support", "messages": messages, "max_tokens": 4},
    )  # fmt: skip
    assert theirs.status_code == 404
    assert theirs.json()["error"]["code"] == "model_not_found"
    server.assert_lifecycle()
