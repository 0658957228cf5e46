"""The simulated replica's reading of a `POST /v1/chat/completions` body: the checks vLLM 0.33
makes, in its order and with its error bodies, down to the `Parsed` request the engine runs."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import orjson

from tollgate_llm.engine_adapter.simulator.state import SimConfig
from tollgate_llm.engine_adapter.simulator.tokenizer import prompt_token_ids

_CACHE_SALT_FORBIDDEN = re.compile(r"[@/\\\x00]")
# vLLM's --max-logprobs default: more top_logprobs than this is a 400.
MAX_LOGPROBS = 20


class HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {"message": message, "type": err_type, "param": param, "code": status}
        }


def bad(message: str, param: str | None) -> HTTPError:
    # VLLMValidationError renders as str(exc), which appends the parameter name.
    suffix = f" (parameter={param})" if param else ""
    return HTTPError(400, message + suffix, "BadRequestError", param)


def schema_error(param: str, msg: str) -> HTTPError:
    # pydantic schema errors take a different path in vLLM: type is the HTTP phrase.
    return HTTPError(400, f"1 validation error:\n  {msg}", "Bad Request", f"body.{param}")


@dataclass
class Parsed:
    messages: list[Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int
    ignore_eos: bool
    priority: int
    salt: str | None
    seed: int | None
    fail_after: int | None
    drop_after: int | None
    asked_length: int | None = None
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tool: str | None = None  # the function a natural stop calls (the request offered tools)
    adapter: str = ""  # the LoRA adapter asked for (its name is the answer's `model`)


def parse_chat(
    cfg: SimConfig, content_type: str, priority_header: str | None, raw: bytes,
    adapters: Container[str] = (),
) -> Parsed:
    """The request as the engine runs it, or the `HTTPError` vLLM answers (the first it finds).
    `adapters`: the LoRA adapters loaded, which a request may name as its model."""
    body = _json_object(content_type, raw)
    model = body.get("model")
    adapter = model if isinstance(model, str) and model in adapters else ""
    if model is not None and model != cfg.model and not adapter:
        raise HTTPError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {cfg.model}.",
            "NotFoundError",
            "model",
        )
    messages = _messages(body)
    stream, include_usage, continuous = _stream_flags(body, cfg)
    n = body.get("n")
    if n not in (None, 1):
        raise bad("The simulated replica supports only n=1.", "n")
    salt = _cache_salt(body)
    limit = _asked_limit(body)
    ids = prompt_token_ids(messages)
    limit = _output_limit(cfg, len(ids), limit)
    priority = _priority(body, priority_header)
    seed = body.get("seed")
    logprobs, top_logprobs = _parse_logprobs(body)
    tool = _offered_tool(body)
    return Parsed(
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=limit,
        ignore_eos=bool(body.get("ignore_eos")),
        priority=priority,
        salt=salt,
        seed=seed if isinstance(seed, int) else None,
        fail_after=_opt_int(body.get("sim_fail_after_tokens")),
        drop_after=_opt_int(body.get("sim_drop_after_tokens")),
        asked_length=_asked_length(messages),
        prompt_ids=ids,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tool=tool,
        adapter=adapter,
    )


def _json_object(content_type: str, raw: bytes) -> dict[str, Any]:
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise HTTPError(
            400,
            "Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
            None,
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise schema_error("", f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise schema_error("", "Input should be a valid dictionary")
    return body


def _messages(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise schema_error(
            "messages", "Field required" if messages is None else "Input should be a valid list"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise schema_error(f"messages.{i}", "Input should be a valid message with a role")
    return messages


def _stream_flags(body: dict[str, Any], cfg: SimConfig) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise schema_error("stream", "Input should be a valid boolean")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise schema_error("stream_options", "Input should be a valid dictionary")
    if cfg.enable_force_include_usage:
        return stream, True, True
    so = stream_options or {}
    include_usage = bool(so.get("include_usage"))
    return stream, include_usage, include_usage and bool(so.get("continuous_usage_stats"))


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (
        not isinstance(salt, str)
        or not salt
        or len(salt) > 128
        or _CACHE_SALT_FORBIDDEN.search(salt)
    ):
        raise bad(
            "cache_salt must be a non-empty string of at most 128 characters without "
            "'@', '/', '\\' or NUL.",
            "cache_salt",
        )
    return salt


def _asked_limit(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens`, else `max_tokens`, when given."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise schema_error(name, "Input should be a valid integer")
        if v < 1:
            raise bad(f"{name} must be at least 1, got {v}.", name)
        return v
    return None


def _output_limit(cfg: SimConfig, prompt: int, limit: int | None) -> int:
    if prompt >= cfg.max_model_len:
        raise bad(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
            f"your prompt contains {prompt} input tokens. Please reduce the length of the "
            "input messages.",
            "input_tokens",
        )
    room = cfg.max_model_len - prompt
    # As vLLM 0.32 (checked against the CPU build): a limit above the whole context is
    # refused; one above what the prompt leaves is generated up to the context's end.
    if limit is not None and limit > cfg.max_model_len:
        raise bad(
            f"max_tokens={limit} cannot be greater than max_model_len={cfg.max_model_len}. "
            "Please request fewer output tokens.",
            "max_tokens",
        )
    return room if limit is None else min(limit, room)


def _priority(body: dict[str, Any], header: str | None) -> int:
    priority = body.get("priority", 0)
    if header is not None:
        with contextlib.suppress(ValueError):
            priority = int(header)
    if not isinstance(priority, int):
        raise schema_error("priority", "Input should be a valid integer")
    return priority


def _offered_tool(body: dict[str, Any]) -> str | None:
    """The function a generation that stops on its own calls, as a model served with vLLM's
    tool parser does when it is offered tools (`tool_choice` not "none"): the first one's."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    first = tools[0]
    function = first.get("function") if isinstance(first, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def _parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """`logprobs` and `top_logprobs` as vLLM 0.33 checks them (`check_logprobs`, and the engine's
    --max-logprobs)."""
    logprobs = body.get("logprobs")
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise schema_error("logprobs", "Input should be a valid boolean")
    top = body.get("top_logprobs")
    if top is None:
        return logprobs, 0
    if not isinstance(top, int) or isinstance(top, bool):
        raise schema_error("top_logprobs", "Input should be a valid integer")
    if top < 0 and top != -1:
        raise bad("`top_logprobs` must be a positive value or -1.", "top_logprobs")
    if (top == -1 or top > 0) and not logprobs:
        raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if top > MAX_LOGPROBS or top == -1:
        # -1 asks for the whole vocabulary, which the default --max-logprobs refuses too.
        raise bad(
            f"Requested sample logprobs of {top}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            "top_logprobs",
        )
    return logprobs, top


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


_ASKED_LENGTH = re.compile(r"\bin about (\d{1,6}) words\b")


def _asked_length(messages: list[Any]) -> int | None:
    """The answer length the last user message asks for ("... in about 120 words"), if any:
    the simulated model follows it roughly (SimConfig.length_follow_sigma)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            found = _ASKED_LENGTH.search(content) if isinstance(content, str) else None
            return int(found.group(1)) if found else None
    return None
