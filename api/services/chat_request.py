"""Parse and validate an OpenAI chat-completions body by hand.

A pydantic model costs more CPU per request than the whole admission path, so the checks are
written out: every field OpenAI (or vLLM, for its extra sampling fields) validates is refused here
with a 400 naming the field, before admission, so that nothing the engine would reject is admitted,
routed and billed first. Only allow-listed fields reach the engine: a client cannot set the
engine-side `priority`, `cache_salt` or `request_id` of its own accord.

Error messages name the field and the rule, never the value: a value can be megabytes long, and the
message is echoed to the client and stored (truncated) in the refusal event.

`FIELDS` is the one table of the body's fields: each field's check and its JSON schema, made from
the same bounds, beside each other. `request_schema()` is the published schema of the body
(`/openapi.json`, api/http/openapi.py), built from it; parsing reads only the checks (`_CHECKS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tollgate_llm.api.services.chat_messages import (
    ROLES,
    Bad,
    check_messages,
    need,
    one_of,
)
from tollgate_llm.api.services.chat_schema import (
    BOOLEAN,
    FUNCTION_NAME,
    STRING,
    const,
    enum_of,
    message_schema,
    named_schema,
    nullable,
    obj,
)
from tollgate_llm.api.services.errors import ApiError, bad_request
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.end_users import MAX_END_USER_CHARS
from tollgate_llm.domain.text import check_metadata, unstorable

# The model name reaches the refusal event, the 404 message and the read models, whose model
# columns are 200 characters wide (ledger/schema.py; PostgreSQL enforces it). That holds any
# Hugging Face `org/name` (96 + 1 + 96).
MAX_MODEL_CHARS = 200
# Container levels (objects and arrays) below the body object. The engine adapter serialises the
# forwarded body with orjson, which fails at 255 levels although orjson.loads accepts 1,024; 64
# holds any real tool or response schema (OpenAI's strict schemas stop at 10 levels).
MAX_NESTING = 64
MAX_STOP_SEQUENCES = 4
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20
MAX_N = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_MESSAGE_KEYS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "function_call", "audio"}
)
TOOL_CHOICES = frozenset({"none", "auto", "required"})
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema", "structural_tag"})
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
# OpenAI's `service_tier` values Tollgate serves: "auto" and "default" are the interactive class,
# "flex" the preemptible, discounted one (domain/types.py ServiceTier).
SERVICE_TIERS = {"auto": "default", "default": "default", "flex": "flex"}

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
    service_tier: str = "default"  # the class asked for: "default" (interactive) | "flex"
    batch_item: str = ""  # "<batch id>/<custom_id>" when the batch runner sends it
    # The caller's own customer, as the client named it (`safety_identifier`, else `user`; the
    # X-Tollgate-End-User header replaces both: `Edge.chat`). In memory only: what is recorded
    # is its keyed hash (api/services/end_user_step.py), never this.
    end_user: str = ""
    end_user_hash: str = ""  # the tenant's keyed hash of it: what admission records


def parse_chat_request(raw: bytes) -> ChatRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson's message quotes the text around the error: never echo the body.
        raise bad_request("request body is not valid JSON") from None
    if type(body) is not dict:
        raise bad_request("request body must be a JSON object")

    model = _model(body)
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        raise _missing_or_type(messages, "messages", "a non-empty array")
    check_messages(messages)

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif type(stream) is not bool:
        raise _type("stream", "a boolean")
    include_usage, continuous = _stream_options(body, stream)
    service_tier = _service_tier(body)
    max_tokens = _positive_int(body, "max_completion_tokens")
    legacy_max_tokens = _positive_int(body, "max_tokens")  # checked even when it loses
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    # Only the fields present are looked at: an ordinary request has four or five.
    for name, value in body.items():
        check = _CHECKS.get(name)
        if check is not None and value is not None:
            check(value, body)

    upstream = {k: v for k, v in body.items() if k in FORWARDED}
    # No value nests deeper than the body has opening brackets (those inside strings only add):
    # an ordinary body has too few for the walk to be needed.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING:
        _check_nesting(upstream)
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        upstream=upstream,
        service_tier=service_tier,
        end_user=body.get("safety_identifier") or body.get("user") or "",
    )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if type(model) is not str or not model:
        raise _missing_or_type(model, "model", "a non-empty string")
    if len(model) > MAX_MODEL_CHARS:
        raise _too_long("model", MAX_MODEL_CHARS)
    # An unknown model's name is recorded in its refusal (and read into request_log): one that
    # PostgreSQL cannot hold is refused here, as invalid, and never reaches the store.
    if "\x00" in model or not model.isascii():
        _check_storable(model, "model")
    return model


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of `stream_options`, allowed only with a stream."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if type(options) is not dict:
        raise _type("stream_options", "an object")
    if not stream:
        raise bad_request("stream_options can only be defined when stream=true", "stream_options")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    continuous = include_usage and _flag(
        options, "continuous_usage_stats", "stream_options.continuous_usage_stats"
    )
    return include_usage, continuous


def _service_tier(body: dict[str, Any]) -> str:
    """The tier asked for, "auto" read as "default"."""
    service_tier = body.get("service_tier")
    if service_tier is None:
        return "default"
    if type(service_tier) is not str or service_tier not in SERVICE_TIERS:
        raise bad_request("'service_tier' must be one of auto, default, flex", "service_tier")
    return SERVICE_TIERS[service_tier]


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")


# --- the other fields, each checked only when present and not null ------------------------------

Check = Callable[[Any, dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class Spec:
    """A body field: how it is checked when present and not null (None: by `parse_chat_request`
    itself), and its JSON schema. `required` fields take no null; every other field does, for
    "not given"."""

    check: Check | None
    schema: dict[str, Any]
    required: bool = False
    description: str | None = None

    def described(self, description: str) -> Spec:
        return Spec(self.check, self.schema, self.required, description)


def _number(name: str, low: float, high: float, *, low_open: bool = False) -> Spec:
    rule = f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: Any, body: dict[str, Any]) -> None:
        if type(value) is not int and type(value) is not float:
            raise _type(name, "a number")
        if not (low < value if low_open else low <= value) or not value <= high:
            raise bad_request(f"'{name}' {rule}", name)

    bound = {"exclusiveMinimum": low} if low_open else {"minimum": low}
    return Spec(check, {"type": "number", **bound, "maximum": high})


def _integer(name: str, low: int, high: int) -> Spec:
    rule = f"an integer >= {low}" if high == INT64_MAX else f"an integer in [{low}, {high}]"

    def check(value: Any, body: dict[str, Any]) -> None:
        if type(value) is not int:
            raise _type(name, "an integer")
        if not low <= value <= high:
            raise bad_request(f"'{name}' must be {rule}", name)

    return Spec(check, {"type": "integer", "minimum": low, "maximum": high})


def _boolean(name: str) -> Spec:
    def check(value: Any, body: dict[str, Any]) -> None:
        if type(value) is not bool:
            raise _type(name, "a boolean")

    return Spec(check, BOOLEAN)


def _end_user(name: str) -> Spec:
    """`user` and `safety_identifier`: the caller's end user (never forwarded nor stored; its
    keyed hash is recorded), a string of at most MAX_END_USER_CHARS characters."""

    def check(value: Any, body: dict[str, Any]) -> None:
        if type(value) is not str:
            raise _type(name, "a string")
        if len(value) > MAX_END_USER_CHARS:
            raise _too_long(name, MAX_END_USER_CHARS)
        _check_storable(value, name)

    return Spec(check, {"type": "string", "maxLength": MAX_END_USER_CHARS})


def _check_metadata(value: Any, body: dict[str, Any]) -> None:
    # Not forwarded nor stored today, but checked as OpenAI checks it (16 pairs, keys <= 64 and
    # values <= 512 characters) and as storable, so that keeping it later needs no new rule.
    try:
        check_metadata(value)
    except DomainError as exc:
        code = "invalid_type" if exc.rule == "invalid_type" else "invalid_value"
        raise bad_request(exc.message, exc.field, code=code) from None


_n_range = _integer("n", 1, MAX_N).check
_top_logprobs_range = _integer("top_logprobs", 0, MAX_TOP_LOGPROBS).check


def _check_n(value: Any, body: dict[str, Any]) -> None:
    _n_range(value, body)
    if value != 1:
        raise bad_request("only n=1 is supported", "n", code="unsupported_value")


def _check_top_logprobs(value: Any, body: dict[str, Any]) -> None:
    _top_logprobs_range(value, body)
    if body.get("logprobs") is not True:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")


def _check_stop(value: Any, body: dict[str, Any]) -> None:
    if type(value) is str:
        return
    if type(value) is not list:
        raise _type("stop", "a string or an array of strings")
    if not 1 <= len(value) <= MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop' takes 1 to {MAX_STOP_SEQUENCES} sequences", "stop")
    for j, item in enumerate(value):
        if type(item) is not str:
            raise _type(f"stop[{j}]", "a string")


def _check_stop_token_ids(value: Any, body: dict[str, Any]) -> None:
    if type(value) is not list:
        raise _type("stop_token_ids", "an array of integers")
    for j, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= INT64_MAX:
            raise _type(f"stop_token_ids[{j}]", "a non-negative integer")


def _check_logit_bias(value: Any, body: dict[str, Any]) -> None:
    if type(value) is not dict:
        raise _type("logit_bias", "an object mapping token ids to numbers")
    for token, bias in value.items():
        if not token.isascii() or not token.isdigit():
            raise bad_request("'logit_bias' keys must be token ids (integers)", "logit_bias")
        if type(bias) is not int and type(bias) is not float:
            raise _type("logit_bias", "an object mapping token ids to numbers")
        if not -100 <= bias <= 100:
            raise bad_request("'logit_bias' values must be in [-100, 100]", "logit_bias")


def _check_response_format(value: Any, body: dict[str, Any]) -> None:
    if type(value) is not dict:
        raise _type("response_format", "an object")
    try:
        if not one_of(value.get("type"), RESPONSE_FORMATS):
            raise Bad(".type", f"must be one of {', '.join(sorted(RESPONSE_FORMATS))}")
        if value["type"] == "json_schema":
            spec = need(value, "json_schema", dict, "an object")
            _checknamed_schema(spec, "schema", ".json_schema")
    except Bad as bad:
        raise bad.at("response_format") from None


def _check_tools(value: Any, body: dict[str, Any]) -> None:
    if type(value) is not list:
        raise _type("tools", "an array")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' takes at most {MAX_TOOLS} functions", "tools")
    for j, tool in enumerate(value):
        try:
            if type(tool) is not dict:
                raise Bad("", "must be an object", "invalid_type")
            if tool.get("type") != "function":
                raise Bad(".type", "must be function")
            function = need(tool, "function", dict, "an object")
            _checknamed_schema(function, "parameters", ".function")
        except Bad as bad:
            raise bad.at(f"tools[{j}]") from None


def _checknamed_schema(spec: dict[str, Any], schema_key: str, where: str) -> None:
    """A function of `tools` or a response's json_schema: a name, a JSON schema under
    `schema_key`, an optional description and strict flag."""
    name = spec.get("name")
    if type(name) is not str or not FUNCTION_NAME.fullmatch(name):
        raise Bad(f"{where}.name", "must be 1-64 letters, digits, _ or -")
    _optional(spec, "description", str, "a string", where)
    _optional(spec, schema_key, dict, "an object", where)
    _optional(spec, "strict", bool, "a boolean", where)


def _check_tool_choice(value: Any, body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if type(value) is str:
        if value not in TOOL_CHOICES:
            raise bad_request(
                "'tool_choice' must be none, auto, required or a named function", "tool_choice"
            )
        if value != "none" and not tools:
            raise bad_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return
    if type(value) is not dict:
        raise _type("tool_choice", "a string or an object")
    function = value.get("function")
    if value.get("type") != "function" or type(function) is not dict:
        raise bad_request(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = function.get("name")
    if type(name) is not str:
        raise _missing_or_type(name, "tool_choice.function.name", "a string")
    if type(tools) is not list or not any(
        type(t) is dict and type(t.get("function")) is dict and t["function"].get("name") == name
        for t in tools
    ):
        raise bad_request(
            "'tool_choice.function.name' is not a function in 'tools'",
            "tool_choice.function.name",
        )


def _check_reasoning_effort(value: Any, body: dict[str, Any]) -> None:
    if not one_of(value, REASONING_EFFORTS):
        raise bad_request(
            f"'reasoning_effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}",
            "reasoning_effort",
        )


def _check_chat_template_kwargs(value: Any, body: dict[str, Any]) -> None:
    if type(value) is not dict:
        raise _type("chat_template_kwargs", "an object")


def _optional(obj: dict[str, Any], key: str, kind: type, expected: str, where: str) -> None:
    value = obj.get(key)
    if value is not None and type(value) is not kind:
        raise Bad(f"{where}.{key}", f"must be {expected}", "invalid_type")


# --- the table ---------------------------------------------------------------------------------
# The schemas of the structured fields state what their checks above check; the cross-field rules
# (stream_options only with stream, top_logprobs only with logprobs, tool_choice only with tools)
# are stated in the body's `allOf`, nesting in its description.

# `max_completion_tokens` and `max_tokens`, checked by `_positive_int`.
_POSITIVE = Spec(None, {"type": "integer", "minimum": 1, "maximum": INT64_MAX})


FIELDS: dict[str, Spec] = {
    "model": Spec(None, {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS}, True,
                  "a model name (its newest version on sale) or a pinned version "
                  "(`llama-3.1-8b-2026-05`); GET /v1/models lists them. No NUL (U+0000): a 400"),
    "messages": Spec(None, {"type": "array", "minItems": 1, "items": {
        "oneOf": [message_schema(role) for role in sorted(ROLES)]
    }}, True),
    "stream": Spec(None, BOOLEAN),
    "stream_options": Spec(None, obj(
        [], include_usage=nullable(BOOLEAN), continuous_usage_stats=nullable(BOOLEAN)
    )),
    "max_completion_tokens": _POSITIVE,
    "max_tokens": _POSITIVE.described(
        "max_completion_tokens wins; both are capped by the tenant's max_output"
    ),
    "n": Spec(_check_n, {"type": "integer", "minimum": 1, "maximum": 1},
              description=f"OpenAI takes up to {MAX_N}; only 1 is served"),
    "temperature": _number("temperature", 0, 2),
    # vLLM refuses top_p = 0 (OpenAI takes it): refused here rather than after admission.
    "top_p": _number("top_p", 0, 1, low_open=True).described("(0, 1], as vLLM takes it"),
    "presence_penalty": _number("presence_penalty", -2, 2),
    "frequency_penalty": _number("frequency_penalty", -2, 2),
    "min_p": _number("min_p", 0, 1),
    "repetition_penalty": _number("repetition_penalty", 0, 2, low_open=True),
    "seed": _integer("seed", INT64_MIN, INT64_MAX),
    # vLLM 0.33: 0 or -1 disables top-k, else at least 1.
    "top_k": _integer("top_k", -1, INT64_MAX).described("vLLM: 0 or -1 disables top-k"),
    "min_tokens": _integer("min_tokens", 0, INT64_MAX),
    "logprobs": _boolean("logprobs"),
    "top_logprobs": Spec(
        _check_top_logprobs, {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        description="needs logprobs: true",
    ),
    "parallel_tool_calls": _boolean("parallel_tool_calls"),
    "ignore_eos": _boolean("ignore_eos"),
    "include_stop_str_in_output": _boolean("include_stop_str_in_output"),
    "skip_special_tokens": _boolean("skip_special_tokens"),
    "user": _end_user("user").described(
        "the caller's end user: its per-end-user limits and budget apply (`tollgate limits set "
        "--per-end-user`), and billing groups by its keyed hash (never stored in clear); no NUL"
    ),
    "safety_identifier": _end_user("safety_identifier").described(
        "the same as `user`, which it replaces when both are given; the X-Tollgate-End-User "
        "header replaces both"
    ),
    "metadata": Spec(_check_metadata, {
        "type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
    }),  # fmt: skip
    "service_tier": Spec(None, {"type": "string", "enum": list(SERVICE_TIERS)}, description=(
        "flex: idle capacity only, preemptible, at the flex price; a 429 "
        "`resource_unavailable` when there is none (not billed)"
    )),  # fmt: skip
    "stop": Spec(_check_stop, {"anyOf": [STRING, {
        "type": "array", "items": STRING, "minItems": 1, "maxItems": MAX_STOP_SEQUENCES
    }]}),  # fmt: skip
    "stop_token_ids": Spec(_check_stop_token_ids, {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
    }),  # fmt: skip
    "logit_bias": Spec(_check_logit_bias, {
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }),  # fmt: skip
    "response_format": Spec(_check_response_format, {"oneOf": [
        obj(["type"], type=const(kind)) if kind != "json_schema" else obj(
            ["type", "json_schema"], type=const(kind), json_schema=named_schema("schema")
        ) for kind in sorted(RESPONSE_FORMATS)
    ]}),  # fmt: skip
    "tools": Spec(_check_tools, {"type": "array", "maxItems": MAX_TOOLS, "items": obj(
        ["type", "function"], type=const("function"), function=named_schema("parameters")
    )}),  # fmt: skip
    "tool_choice": Spec(_check_tool_choice, {"anyOf": [enum_of(TOOL_CHOICES), obj(
        ["type", "function"], type=const("function"), function=obj(["name"], name=STRING)
    )]}),  # fmt: skip
    "reasoning_effort": Spec(_check_reasoning_effort, enum_of(REASONING_EFFORTS)),
    "chat_template_kwargs": Spec(_check_chat_template_kwargs, {"type": "object"}),
    # The simulated replica's fault injection (engine_adapter/README.md); not published.
    "sim_fail_after_tokens": _integer("sim_fail_after_tokens", 0, INT64_MAX),
    "sim_drop_after_tokens": _integer("sim_drop_after_tokens", 0, INT64_MAX),
}
_UNPUBLISHED = frozenset({"sim_fail_after_tokens", "sim_drop_after_tokens"})
# What parsing reads: the checks of the fields `parse_chat_request` does not check itself.
_CHECKS: dict[str, Check] = {
    name: spec.check for name, spec in FIELDS.items() if spec.check is not None
}


def _if_given(field: str, when: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": {"required": [field], "properties": {field: when}}, "then": then}


def request_schema() -> dict[str, Any]:
    """The body's JSON schema, from `FIELDS`: what /openapi.json publishes."""
    properties = {}
    for name, spec in FIELDS.items():
        if name in _UNPUBLISHED:
            continue
        schema = spec.schema if spec.required else nullable(spec.schema)
        properties[name] = {**schema, "description": spec.description} if spec.description else (
            schema
        )
    return {
        "type": "object",
        "required": [name for name, spec in FIELDS.items() if spec.required],
        "description": (
            "OpenAI's chat-completions request. Fields not listed are accepted and ignored (as "
            "vLLM does); only the listed ones reach the engine, and never a client's "
            "`priority`, `cache_salt` or `request_id`. Also answered 400: `stream_options` "
            "without `stream: true`, `top_logprobs` without `logprobs: true`, a `tool_choice` "
            "other than `none` without `tools` (or naming a function not in them), and any "
            f"field nested more than {MAX_NESTING} levels below the body."
        ),
        "allOf": [
            _if_given("stream_options", {"type": "object"},
                      {"required": ["stream"], "properties": {"stream": {"const": True}}}),
            _if_given("top_logprobs", {"type": "integer"},
                      {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
            _if_given("tool_choice", {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}},
                      {"required": ["tools"],
                       "properties": {"tools": {"type": "array", "minItems": 1}}}),
        ],  # fmt: skip
        "properties": properties,
    }


# --- helpers -------------------------------------------------------------------------------------


def _check_nesting(upstream: dict[str, Any]) -> None:
    """Refuse a forwarded field nested more than MAX_NESTING containers below the body, naming
    it (a message's field by its index)."""
    for name, value in upstream.items():
        kind = type(value)
        if kind is not dict and kind is not list:
            continue
        if name == "messages":
            for i, message in enumerate(value):
                # body > messages > message > its fields: MAX_NESTING - 2 levels left for them.
                for key, field in message.items():
                    kind = type(field)
                    if (kind is dict or kind is list) and _too_deep(field, MAX_NESTING - 2):
                        raise _too_nested(f"messages[{i}].{key}")
        elif _too_deep(value, MAX_NESTING):
            raise _too_nested(name)


def _too_nested(param: str) -> ApiError:
    return bad_request(
        f"'{param}' is nested more than {MAX_NESTING} levels deep",
        param,
        code="nesting_too_deep",
    )


def _too_deep(container: Any, levels: int) -> bool:
    """Whether a dict or list has more than `levels` levels of containers (itself one)."""
    if levels <= 0:
        return True
    below = levels - 1
    for item in container.values() if type(container) is dict else container:
        kind = type(item)
        if (kind is dict or kind is list) and _too_deep(item, below):
            return True
    return False


def _flag(options: dict[str, Any], key: str, param: str) -> bool:
    value = options.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise _type(param, "a boolean")
    return value


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise _type(name, "a positive integer")
    if not 1 <= value <= INT64_MAX:
        raise bad_request(f"'{name}' must be a positive 64-bit integer", name)
    return value


def _type(param: str, expected: str) -> ApiError:
    return bad_request(f"'{param}' must be {expected}", param, code="invalid_type")


def _missing(param: str) -> ApiError:
    return bad_request(
        f"missing required parameter '{param}'", param, code="missing_required_parameter"
    )


def _missing_or_type(value: Any, param: str, expected: str) -> ApiError:
    return _missing(param) if value is None else _type(param, expected)


def _check_storable(value: str, param: str) -> None:
    reason = unstorable(value)
    if reason is not None:
        raise bad_request(f"'{param}' {reason}", param, code="invalid_value")


def _too_long(param: str, limit: int) -> ApiError:
    return bad_request(
        f"'{param}' is longer than {limit} characters", param, code="string_above_max_length"
    )
