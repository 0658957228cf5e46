"""The hand-written chat-completions validation (api/services/chat_request.py): what OpenAI and vLLM
refuse is refused here, with a 400 naming the field and never quoting the value; what they accept
is accepted and forwarded."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tollgate_llm.api.services.chat_request import MAX_MODEL_CHARS, MAX_NESTING, parse_chat_request
from tollgate_llm.api.services.errors import ApiError

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def body(**fields: Any) -> bytes:
    text = json.dumps({"model": "m", "messages": [USER], **fields})
    # `nested(n)` placeholders become n nested arrays (json.dumps itself stops near 1,000).
    deep = re.sub(r'"nested:(\d+)"', lambda m: "[" * int(m[1]) + "1" + "]" * int(m[1]), text)
    return deep.encode()


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(raw)
    error = caught.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    return error


def nested(levels: int) -> str:
    """`levels` nested arrays around a 1, once `body` has rendered it."""
    return f"nested:{levels}"


# Each: the body's extra fields, the param the 400 names. The first ones are issue 14's hole 3.
INVALID = [
    ({"tools": "x"}, "tools"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # only with logprobs
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["a", 5]}, "stop[1]"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),  # vLLM: (0, 1]
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
    ({"n": 2}, "n"),  # valid for OpenAI, unsupported here
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"50256": 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"user": 5}, "user"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"tools": [{"type": "custom"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL] * 129}, "tools"),
    ({"tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [TOOL]},
     "tool_choice.function.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": ["text"]}}, "response_format.type"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [1, 2]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "texte", "text": "x"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url",
                                                  "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),  # images come from users
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "x", "detail": "max"}}]}]},
     "messages[0].content[0].image_url.detail"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                "input_audio": {"data": "x", "format": "ogg"}}]}]},
     "messages[0].content[0].input_audio.format"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),  # unhashable
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"messages": [USER, {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": 5}]}]},
     "messages[1].tool_calls[0].id"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": []}]}, "messages[1].content"),
    ({"model": "m" * (MAX_MODEL_CHARS + 1)}, "model"),
    ({"model": ""}, "model"),
    ({"model": 5}, "model"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_invalid_values_are_400_naming_the_param(fields: dict[str, Any], param: str) -> None:
    error = refused(body(**fields))
    assert error.param == param, error.message
    assert error.code
    body_error = error.body()["error"]
    assert set(body_error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]},
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "s", "schema": {"a": nested(256)}}}},
        {"logit_bias": {"1": nested(256)}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                    "extra": nested(256)}]}]},
        {"messages": [{"role": "user", "content": "x", "metadata": nested(1000)}]},
        {"chat_template_kwargs": {"a": nested(256)}},
        {"tool_choice": {"type": "function", "function": {"name": "f", "x": nested(300)}},
         "tools": [{"type": "function", "function": {"name": "f"}}]},
    ],
)
def test_nesting_the_engine_adapter_cannot_serialise_is_400(fields: dict[str, Any]) -> None:
    """Hole 2: orjson.loads takes 1,024 levels, orjson.dumps (the engine adapter) fails at 255,
    and a request that parsed used to be admitted and then failed."""
    error = refused(body(**fields))
    assert error.param is not None
    assert error.param.split("[")[0].split(".")[0] in fields
    assert error.code in {"nesting_too_deep", "invalid_type"}


def test_nesting_is_counted_from_the_body() -> None:
    # body > tools > tool > function > parameters: the parameters object is at level 4 below the
    # body, so it may hold MAX_NESTING - 4 more levels, and not one more.
    def with_depth(levels: int) -> bytes:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"a": nested(levels)}}}
        return body(tools=[tool])

    parse_chat_request(with_depth(MAX_NESTING - 4))
    assert refused(with_depth(MAX_NESTING - 3)).code == "nesting_too_deep"


def test_a_message_field_nested_too_deep_is_named_by_its_index() -> None:
    messages = [USER, {"role": "user", "content": "x", "extra": nested(200)}]
    assert refused(body(messages=messages)).param == "messages[1].extra"


VALID = [
    {"logprobs": True, "top_logprobs": 20},
    {"logprobs": False},
    {"stop": "END"},
    {"stop": ["a", "b", "c", "d"]},
    {"stop": None, "tools": None, "temperature": None},  # null is "not given"
    {"top_k": -1}, {"top_k": 0}, {"top_k": 40},
    {"top_p": 1}, {"temperature": 0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2},
    {"seed": -(2**63)}, {"n": 1},
    {"logit_bias": {"50256": -100, "13": 2.5}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": {"type": "object"}, "strict": True}}},
    {"tools": [TOOL], "tool_choice": "auto"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": "none"},
    {"reasoning_effort": "low"},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                  {"role": "user", "content": [
                      {"type": "text", "text": "what is this?"},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                          "detail": "low"}}]},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                  {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
    {"unknown_field": {"ignored": True}},  # as vLLM: accepted, not forwarded
]


@pytest.mark.parametrize("fields", VALID)
def test_valid_values_are_accepted(fields: dict[str, Any]) -> None:
    request = parse_chat_request(body(**fields))
    for name, value in fields.items():
        if name in {"unknown_field"}:
            assert name not in request.upstream
        elif name != "n":
            assert request.upstream[name] == value


def test_error_messages_never_quote_the_value() -> None:
    canary = "canary-" + "q" * 5000
    cases = [
        body(model=canary),
        body(temperature=canary),
        body(messages=[{"role": canary, "content": "x"}]),
        body(response_format={"type": canary}),
        json.dumps({"model": "m", "messages": [USER], "x": canary})[:-10].encode(),  # bad JSON
    ]
    for raw in cases:
        error = refused(raw)
        assert "canary" not in error.message and "qqqq" not in error.message, error.message


@pytest.mark.parametrize("value", ["priority", "scale", "", 1, True, ["flex"]])
def test_a_service_tier_other_than_auto_default_flex_is_400_naming_it(value: Any) -> None:
    error = refused(body(service_tier=value))
    assert error.param == "service_tier"


@pytest.mark.parametrize(
    ("value", "parsed"), [(None, "default"), ("auto", "default"), ("default", "default"),
                          ("flex", "flex")]
)
def test_service_tier_auto_is_the_default_class_and_is_never_forwarded(
    value: Any, parsed: str
) -> None:
    req = parse_chat_request(body(service_tier=value))
    assert req.service_tier == parsed
    assert "service_tier" not in req.upstream
