"""Parse and validate an OpenAI chat-completions body by hand.

A pydantic model costs more CPU per request than the whole admission path; these checks are the
ones whose failure must be a 400 naming the field. Only allow-listed fields reach the engine, so a
client cannot set the engine-side `priority`, `cache_salt` or `request_id` of its own accord.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from api.errors import ApiError, bad_request

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Fields forwarded to the engine as the client sent them (after the checks below).
FORWARDED = frozenset(
    {
        "messages",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "seed",
        "stop",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_effort",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "chat_template_kwargs",
        # The simulated replica's fault injection (engine_adapter/README.md): real vLLM ignores
        # unknown fields, and a client can only make its own request fail with them.
        "sim_fail_after_tokens",
        "sim_drop_after_tokens",
    }
)


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[Any]
    stream: bool
    include_usage: bool  # the client asked for the final usage chunk
    continuous_usage: bool  # ... and for usage on every chunk
    max_tokens: int | None  # what the client asked (max_completion_tokens wins over max_tokens)
    upstream: dict[str, Any]  # the allow-listed body we forward
    body_sha256: str = ""


def parse_chat_request(raw: bytes) -> ChatRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {sorted(ROLES)}", f"messages[{i}].role"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_request(
                f"messages[{i}].content must be a string or an array", f"messages[{i}].content"
            )

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    include_usage = continuous = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request(
                "stream_options can only be defined when stream=true", "stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))

    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", "n")
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise bad_request(f"'{name}' must be a number in [{low}, {high}]", name)

    upstream = {k: v for k, v in body.items() if k in FORWARDED}
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        upstream=upstream,
    )


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer", name)
    return value


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
