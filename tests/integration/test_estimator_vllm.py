"""The admission estimate is the engine's count: the tiny model's own tokenizer and chat template
(engine_adapter/tokenizers.py) against real vLLM's `usage.prompt_tokens`, for every test chat."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.vllm.prompts import CHATS
from tollgate_llm.engine_adapter.estimators import WordTokenEstimator
from tollgate_llm.engine_adapter.tokenizers import ChatTemplateEstimator, estimator_for


@pytest.fixture(scope="module")
def estimator(vllm_server: Any) -> ChatTemplateEstimator:
    found = estimator_for(simulated=False, model_dir=vllm_server.model_dir)
    assert isinstance(found, ChatTemplateEstimator)
    return found


def engine_prompt_tokens(server: Any, messages: list[Any], tools: list[Any] | None) -> int:
    body: dict[str, Any] = {"model": server.model, "messages": messages, "max_tokens": 1}
    if tools:
        # "auto" needs a tool-call parser the tiny model has none of; "none" still renders the
        # tools into the prompt (vLLM keeps them unless told to exclude them).
        body["tools"] = tools
        body["tool_choice"] = "none"
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


@pytest.mark.parametrize(("name", "messages", "tools"), CHATS, ids=[c[0] for c in CHATS])
def test_estimate_equals_vllm_prompt_tokens(
    vllm_server: Any, estimator: ChatTemplateEstimator, name: str, messages: Any, tools: Any
) -> None:
    assert estimator.prompt_tokens(messages, tools) == engine_prompt_tokens(
        vllm_server, messages, tools
    )


def test_the_rendered_prompt_is_what_vllm_tokenizes(
    vllm_server: Any, estimator: ChatTemplateEstimator
) -> None:
    """The same token ids, not only the same count (vLLM's /tokenize applies the template)."""
    messages = CHATS[4][1]
    r = httpx.post(
        f"{vllm_server.url}/tokenize",
        json={"model": vllm_server.model, "messages": messages},
        timeout=30,
    )
    ids = estimator._tokenizer.encode(estimator.render(messages), add_special_tokens=False).ids
    assert ids == r.json()["tokens"]


def test_cached_answers_are_the_computed_ones(estimator: ChatTemplateEstimator) -> None:
    for _, messages, tools in CHATS:
        first = estimator.prompt_tokens(messages, tools)
        assert estimator.prompt_tokens(messages, tools) == first


def test_simulated_replicas_get_the_simulators_count() -> None:
    from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens

    chosen = estimator_for(simulated=True)
    assert isinstance(chosen, WordTokenEstimator)
    messages = CHATS[3][1]
    assert chosen.prompt_tokens(messages) == count_prompt_tokens(messages)


def test_a_real_replica_without_a_readable_tokenizer_has_none(tmp_path: Any) -> None:
    assert estimator_for(simulated=False, model_dir=None) is None
    assert estimator_for(simulated=False, model_dir=tmp_path) is None
