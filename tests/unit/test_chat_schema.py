"""The published chat body schema (`request_schema()`, built from `FIELDS` in
api/services/chat_request.py) and the checks that parse the body say the same thing: at each
field's bounds, just past them and for the wrong type, the schema accepts exactly what
`parse_chat_request` accepts."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest

from tollgate_llm.api.services.chat_request import (
    _CHECKS,
    _UNPUBLISHED,
    FIELDS,
    parse_chat_request,
    request_schema,
)
from tollgate_llm.api.services.errors import ApiError

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SCHEMA = jsonschema_rs.validator_for(request_schema())


def accepted(body: dict[str, Any]) -> bool:
    try:
        parse_chat_request(json.dumps(body).encode())
    except ApiError as exc:
        assert exc.status == 400
        return False
    return True


def probes(name: str) -> list[Any]:
    """Values at and around the field's stated bounds, and of other types."""
    schema = FIELDS[name].schema
    values: list[Any] = [None, "text", [], {}, True]
    if schema.get("type") in ("number", "integer"):
        step = 1 if schema["type"] == "integer" else 0.001
        for key in ("minimum", "exclusiveMinimum", "maximum"):
            if key in schema:
                values += [schema[key] - step, schema[key], schema[key] + step]
        values += [0, 1, 1.5]
    for option in schema.get("enum", ()):
        values += [option, option.upper()]
    return values


def context(name: str) -> dict[str, Any]:
    """What a field needs beside it to be judged alone (the cross-field rules)."""
    return {
        "top_logprobs": {"logprobs": True},
        "stream_options": {"stream": True},
        "tool_choice": {"tools": [TOOL]},
    }.get(name, {})


SCALARS = [
    name for name, spec in FIELDS.items()
    if name not in _UNPUBLISHED and (
        spec.schema.get("type") in ("number", "integer", "boolean") or "enum" in spec.schema
    )
]  # fmt: skip


@pytest.mark.parametrize("name", SCALARS)
def test_the_schema_accepts_what_the_check_accepts(name: str) -> None:
    for value in probes(name):
        body = {"model": "m", "messages": [USER], **context(name), name: value}
        assert SCHEMA.is_valid(body) == accepted(body), (name, value)


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": ["a", "b", "c", "d"]},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": []},
        {"stop_token_ids": [0, 7]},
        {"stop_token_ids": [-1]},
        {"logit_bias": {"42": 100}},
        {"logit_bias": {"42": 101}},
        {"logit_bias": {"x": 1}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a-b_1"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        {"response_format": {"type": "xml"}},
        {"tools": [TOOL] * 128},
        {"tools": [TOOL] * 129},
        {"tools": [{"type": "function", "function": {"name": "get\n"}}]},
        {"tool_choice": "auto"},
        {"tool_choice": "auto", "tools": [TOOL]},
        {"tool_choice": "none"},
        {"stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"top_logprobs": 3},
        {"metadata": {"k": "v"}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {str(i): "v" for i in range(17)}},
        {"messages": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        {"messages": [{"role": "assistant"}]},
        {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{}"}}
        ]}]},  # fmt: skip
        {"messages": [{"role": "system", "content": [{"type": "image_url",
                                                       "image_url": {"url": "u"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "u"}}]}]},
        {"model": ""},
        {"model": "m" * 201},
    ],
)
def test_structured_fields_agree(fields: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [USER], **fields}
    assert SCHEMA.is_valid(body) == accepted(body)


def test_every_checked_field_is_published_and_parsing_reads_the_same_checks() -> None:
    published = set(request_schema()["properties"])
    assert set(_CHECKS) - _UNPUBLISHED <= published
    assert all(_CHECKS[name] is FIELDS[name].check for name in _CHECKS)
