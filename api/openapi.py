"""The published OpenAPI document (`GET /openapi.json`).

FastAPI describes the routes it serves from their signatures, and ours take their query
parameters by hand (the same parsing serves the web pages and the CLI), so it would describe no
parameter and no error. `POST /v1/chat/completions` is served in front of FastAPI (api/app.py)
and would be missing altogether. This module holds what each operation takes and answers, and
`install` lays it over FastAPI's document. `tests/e2e/test_openapi.py` checks that every route
is described, and a schema fuzzer (`tests/e2e/test_api_fuzz.py`) that the server keeps to it.

The chat request schema states what `api/chat_request.py` checks, field for field; the rules that
span fields (stream_options only with stream, top_logprobs only with logprobs, tool_choice only
with tools, nesting at most 64 levels) are in the descriptions and answered 400.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.chat_request import (
    AUDIO_FORMATS,
    IMAGE_DETAILS,
    INT64_MAX,
    INT64_MIN,
    MAX_MODEL_CHARS,
    MAX_NESTING,
    MAX_STOP_SEQUENCES,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    REASONING_EFFORTS,
    TOOL_CHOICES,
)

JSON = "application/json"


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null: every optional chat field takes null for "not given", as OpenAI's."""
    return {"anyOf": [schema, {"type": "null"}]}


# OpenAI's metadata (domain.text.check_metadata); a NUL in a key or value is a 400 too.
METADATA = nullable({
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
})  # fmt: skip


def obj(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


STRING = {"type": "string"}
INTEGER = {"type": "integer"}
BOOLEAN = {"type": "boolean"}
COUNT = {"type": "integer", "minimum": 0}


def const(value: str) -> dict[str, Any]:
    return {"type": "string", "const": value}


# --- chat completions: the request -------------------------------------------------------------

TEXT_PART = obj(["type", "text"], type=const("text"), text=STRING)
REFUSAL_PART = obj(["type", "refusal"], type=const("refusal"), refusal=STRING)


def url_part(kind: str, **extra: Any) -> dict[str, Any]:
    return obj(["type", kind], type=const(kind), **{kind: obj(["url"], url=STRING, **extra)})


USER_PARTS = [
    TEXT_PART,
    url_part("image_url", detail=nullable({"type": "string", "enum": sorted(IMAGE_DETAILS)})),
    obj(
        ["type", "input_audio"],
        type=const("input_audio"),
        input_audio=obj(
            ["data", "format"],
            data=STRING,
            format={"type": "string", "enum": sorted(AUDIO_FORMATS)},
        ),
    ),
    obj(
        ["type", "file"],
        type=const("file"),
        file=obj(file_data=nullable(STRING), file_id=nullable(STRING), filename=nullable(STRING)),
    ),
    url_part("audio_url"),
    url_part("video_url"),
]


def content(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"anyOf": [STRING, {"type": "array", "items": {"anyOf": parts}}]}


# Checked on every message whatever its role.
COMMON_MESSAGE_FIELDS = {
    "name": nullable(STRING),
    "tool_call_id": nullable(STRING),
    "refusal": nullable(STRING),
}
NO_TOOL_CALLS = {"tool_calls": {"type": "null"}}
TOOL_CALL = obj(
    ["id", "function"],
    id=STRING,
    type=const("function"),
    function=obj(["name", "arguments"], name=STRING, arguments=STRING),
)


def message(
    roles: list[str], content_schema: dict[str, Any], required: list[str], **fields: Any
) -> dict[str, Any]:
    return obj(
        ["role", *required],
        role={"type": "string", "enum": roles},
        content=content_schema,
        **{**COMMON_MESSAGE_FIELDS, **fields},
    )


ASSISTANT_MESSAGE = {
    **message(
        ["assistant"],
        nullable(content([TEXT_PART, REFUSAL_PART])),
        [],
        tool_calls=nullable({"type": "array", "items": TOOL_CALL}),
    ),
    # Content is required unless the message carries tool calls (or a legacy function_call).
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
        {
            "required": ["tool_calls"],
            "properties": {"tool_calls": {"type": "array", "minItems": 1}},
        },
        {"required": ["function_call"], "properties": {"function_call": {"not": {"type": "null"}}}},
    ],
}

MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "oneOf": [
            message(["system", "developer"], content([TEXT_PART]), ["content"], **NO_TOOL_CALLS),
            message(["user"], content(USER_PARTS), ["content"], **NO_TOOL_CALLS),
            ASSISTANT_MESSAGE,
            message(
                ["tool"],
                content([TEXT_PART]),
                ["content", "tool_call_id"],
                tool_call_id=STRING,
                **NO_TOOL_CALLS,
            ),
            message(["function"], nullable(STRING), [], **NO_TOOL_CALLS),
        ]
    },
}

FUNCTION_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}


def named_schema(schema_key: str) -> dict[str, Any]:
    return obj(
        ["name"],
        name=FUNCTION_NAME,
        description=nullable(STRING),
        strict=nullable(BOOLEAN),
        **{schema_key: nullable({"type": "object"})},
    )


def number(low: float, high: float, *, low_open: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": low} if low_open else {"minimum": low}
    return nullable({"type": "number", **bound, "maximum": high})


def integer(low: int, high: int = INT64_MAX) -> dict[str, Any]:
    return nullable({"type": "integer", "minimum": low, "maximum": high})


def needs(field: str, when: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """If `field` is given as `when`, the body must also match `then`."""
    return {"if": {"required": [field], "properties": {field: when}}, "then": then}


CROSS_FIELD_RULES = [
    needs(
        "stream_options",
        {"type": "object"},
        {"required": ["stream"], "properties": {"stream": {"const": True}}},
    ),
    needs(
        "top_logprobs",
        {"type": "integer"},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    ),
    needs(
        "tool_choice",
        {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    ),
]

CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "allOf": CROSS_FIELD_RULES,
    "description": (
        "OpenAI's chat-completions request. Fields not listed are accepted and ignored (as vLLM "
        "does); only the listed ones reach the engine, and never a client's `priority`, "
        "`cache_salt` or `request_id`. Also answered 400: `stream_options` without "
        "`stream: true`, `top_logprobs` without `logprobs: true`, a `tool_choice` other than "
        "`none` without `tools` (or naming a function not in them), and any field nested more "
        f"than {MAX_NESTING} levels below the body."
    ),
    "properties": {
        "model": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_MODEL_CHARS,
            "description": "a model name (its newest version on sale) or a pinned version "
            "(`llama-3.1-8b-2026-05`); GET /v1/models lists them. No NUL (U+0000): a 400",
        },
        "messages": MESSAGES,
        "stream": nullable(BOOLEAN),
        "stream_options": nullable(
            obj(include_usage=nullable(BOOLEAN), continuous_usage_stats=nullable(BOOLEAN))
        ),
        "max_completion_tokens": integer(1),
        "max_tokens": {
            **integer(1),
            "description": "max_completion_tokens wins; both are capped by the tenant's max_output",
        },
        "n": {**integer(1, 1), "description": "OpenAI takes up to 128; only 1 is served"},
        "temperature": number(0, 2),
        "top_p": {**number(0, 1, low_open=True), "description": "(0, 1], as vLLM takes it"},
        "presence_penalty": number(-2, 2),
        "frequency_penalty": number(-2, 2),
        "min_p": number(0, 1),
        "repetition_penalty": number(0, 2, low_open=True),
        "seed": integer(INT64_MIN),
        "top_k": {**integer(-1), "description": "vLLM: 0 or -1 disables top-k"},
        "min_tokens": integer(0),
        "logprobs": nullable(BOOLEAN),
        "top_logprobs": {**integer(0, MAX_TOP_LOGPROBS), "description": "needs logprobs: true"},
        "parallel_tool_calls": nullable(BOOLEAN),
        "ignore_eos": nullable(BOOLEAN),
        "include_stop_str_in_output": nullable(BOOLEAN),
        "skip_special_tokens": nullable(BOOLEAN),
        "user": {**nullable(STRING), "description": "no NUL (U+0000): a 400"},
        "metadata": METADATA,
        "service_tier": {
            "enum": ["auto", "default", "flex", None],
            "description": "flex: idle capacity only, preemptible, at the flex price; a 429 "
            "`resource_unavailable` when there is none (not billed)",
        },
        "stop": nullable(
            {
                "anyOf": [
                    STRING,
                    {
                        "type": "array",
                        "items": STRING,
                        "minItems": 1,
                        "maxItems": MAX_STOP_SEQUENCES,
                    },
                ]
            }
        ),
        "stop_token_ids": nullable(
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}
        ),
        "logit_bias": nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            }
        ),
        "response_format": nullable(
            {
                "oneOf": [
                    obj(["type"], type=const("text")),
                    obj(["type"], type=const("json_object")),
                    obj(
                        ["type", "json_schema"],
                        type=const("json_schema"),
                        json_schema=named_schema("schema"),
                    ),
                    obj(["type"], type=const("structural_tag")),
                ]
            }
        ),
        "tools": nullable(
            {
                "type": "array",
                "maxItems": MAX_TOOLS,
                "items": obj(
                    ["type", "function"],
                    type=const("function"),
                    function=named_schema("parameters"),
                ),
            }
        ),
        "tool_choice": nullable(
            {
                "anyOf": [
                    {"type": "string", "enum": sorted(TOOL_CHOICES)},
                    obj(
                        ["type", "function"],
                        type=const("function"),
                        function=obj(["name"], name=STRING),
                    ),
                ]
            }
        ),
        "reasoning_effort": nullable({"type": "string", "enum": sorted(REASONING_EFFORTS)}),
        "chat_template_kwargs": nullable({"type": "object"}),
    },
}

# --- chat completions: the answers -------------------------------------------------------------

USAGE = obj(
    ["prompt_tokens", "completion_tokens", "total_tokens"],
    prompt_tokens=COUNT,
    completion_tokens=COUNT,
    total_tokens=COUNT,
    prompt_tokens_details=nullable(obj(cached_tokens=COUNT)),
)
LOGPROBS = nullable(obj(content=nullable({"type": "array", "items": {"type": "object"}})))

CHAT_COMPLETION = obj(
    ["id", "object", "created", "model", "choices", "usage"],
    id=STRING,
    object=const("chat.completion"),
    created=INTEGER,
    model=STRING,
    choices={
        "type": "array",
        "items": obj(
            ["index", "message", "finish_reason"],
            index=INTEGER,
            message=obj(
                ["role"],
                role=const("assistant"),
                content=nullable(STRING),
                tool_calls={"type": "array", "items": TOOL_CALL},
            ),
            logprobs=LOGPROBS,
            finish_reason=nullable(STRING),
        ),
    },
    usage=USAGE,
    service_tier={"enum": ["default", "flex"]},
)
CHAT_CHUNK = obj(
    ["id", "object", "created", "model", "choices"],
    id=STRING,
    object=const("chat.completion.chunk"),
    created=INTEGER,
    model=STRING,
    choices={
        "type": "array",
        "items": obj(
            ["index", "delta"],
            index=INTEGER,
            delta={"type": "object"},
            logprobs=LOGPROBS,
            finish_reason=nullable(STRING),
        ),
    },
    usage=nullable(USAGE),
    service_tier={"enum": ["default", "flex"]},
)

# --- the other bodies --------------------------------------------------------------------------

ERROR = obj(
    ["error"],
    error=obj(
        ["message", "type", "param", "code"],
        message={"type": "string", "maxLength": 1024},
        type=STRING,
        param=nullable(STRING),
        code=nullable(STRING),
    ),
)
TOKENS = {"prompt_tokens": COUNT, "completion_tokens": COUNT, "cached_tokens": COUNT}
USAGE_ROW = obj(
    ["tenant", "model", "period_start", "requests", *TOKENS, "amount_micros"],
    tenant=STRING,
    model=STRING,
    period_start=STRING,
    requests=COUNT,
    **TOKENS,
    amount_micros=INTEGER,
    key_id={"type": "string", "description": "with group_by=key"},
    workspace_id=nullable({"type": "string", "description": "with group_by=workspace"}),
    project_id=nullable({"type": "string", "description": "with group_by=project"}),
    run_id=nullable({"type": "string", "description": "with group_by=run"}),
)
PRICES = {
    "prompt_micros_per_mtok": INTEGER,
    "completion_micros_per_mtok": INTEGER,
    "cached_micros_per_mtok": INTEGER,
}
LEDGER_ENTRY = obj(
    [
        "request_id",
        "tenant",
        "key_id",
        "model",
        *TOKENS,
        *PRICES,
        "amount_micros",
        "terminal_reason",
        "admitted_at",
        "finished_at",
        "billed_at",
    ],
    request_id=STRING,
    tenant=STRING,
    key_id=STRING,
    model=STRING,
    **TOKENS,
    **PRICES,
    amount_micros=INTEGER,
    terminal_reason=STRING,
    admitted_at=STRING,
    finished_at=STRING,
    billed_at=STRING,
    workspace_id=nullable(STRING),
    project_id=nullable(STRING),
    run_id=nullable(STRING),
)
INVOICE_LINE = obj(
    [
        "model",
        *PRICES,
        "requests",
        "uncached_prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "amount_micros",
    ],
    model=STRING,
    **PRICES,
    requests=COUNT,
    uncached_prompt_tokens=INTEGER,
    cached_tokens=COUNT,
    completion_tokens=COUNT,
    amount_micros=INTEGER,
)
INVOICE = obj(
    [
        "tenant",
        "period",
        "period_start",
        "period_end",
        "currency_unit",
        "lines",
        "requests",
        "amount_micros",
        "amount",
    ],
    tenant=STRING,
    period=STRING,
    period_start=STRING,
    period_end=STRING,
    currency_unit=const("micro"),
    lines={"type": "array", "items": ref("InvoiceLine")},
    requests=COUNT,
    amount_micros=INTEGER,
    amount=STRING,
)
RECONCILIATION = obj(
    ["from", "to", "totals", "mismatches", "ok"],
    **{"from": STRING},
    to=STRING,
    totals={"type": "object", "additionalProperties": INTEGER},
    mismatches={
        "type": "array",
        "items": obj(["request_id", "problem"], request_id=STRING, problem=STRING),
    },
    ok=BOOLEAN,
)
GROUPS_PATTERN = "^(tenant|tier|model|hour)(,(tenant|tier|model|hour))*$"
GOODPUT_OUTCOMES = (
    "attained", "missed_ttft", "missed_tpot", "cancelled", "failed", "lease_expired",
    "refused_capacity", "shed", "refused_quota", "invalid",
)
GOODPUT_ROW = obj(
    [*GOODPUT_OUTCOMES, "served", "offered", "attainment_ppm", "goodput_ppm"],
    tenant={"type": "string", "description": "with group_by=tenant"},
    tier={"type": "string", "description": "with group_by=tier"},
    model={"type": "string", "description": "with group_by=model"},
    hour={"type": "string", "description": "with group_by=hour: the hour the requests ended"},
    **dict.fromkeys(GOODPUT_OUTCOMES, COUNT),
    served=COUNT,
    offered=COUNT,
    attainment_ppm=nullable({**COUNT, "description": "attained / served, parts per million"}),
    goodput_ppm=nullable({**COUNT, "description": "attained / offered, parts per million"}),
)
FLEET = obj(
    ["policy", "models", "replicas"],
    policy={"type": "object", "description": "the autoscaling policy in force"},
    models={
        "type": "object",
        "additionalProperties": obj(
            ["replicas", "starting", "desired_replicas", "terms"],
            replicas=COUNT,
            starting=COUNT,
            desired_replicas=nullable(COUNT),
            terms=nullable({"type": "object", "description": "what produced the signal"}),
        ),
    },
    replicas={
        "type": "array",
        "items": obj(
            ["replica_id", "model", "healthy", "draining", "kv_occupancy"],
            replica_id=STRING,
            model=STRING,
            healthy=BOOLEAN,
            draining=BOOLEAN,
            reserved_only=BOOLEAN,
            kv_occupancy={"type": "number"},
            effective_occupancy={"type": "number"},
            kv_capacity_tokens=COUNT,
            running=nullable(COUNT),
            waiting=nullable(COUNT),
            last_error=nullable(STRING),
        ),
    },
)
NULLABLE_OBJECT = nullable({"type": "object"})
TIMELINE = obj(
    ["request_id", "status", "quota", "tokens", "events", "anomalies"],
    request_id=STRING,
    status=STRING,
    tenant=nullable(STRING),
    key_id=nullable(STRING),
    model=nullable(STRING),
    tier=nullable(STRING),
    downgraded_from=nullable(STRING),
    plan_at_admission=nullable(STRING),
    limits_at_admission=NULLABLE_OBJECT,
    replica_id=nullable(STRING),
    replica_occupancy_at_routing=nullable({"type": "number"}),
    ttft_ms=nullable(INTEGER),
    tpot_us=nullable(INTEGER),
    quota={"type": "object"},
    tokens={"type": "object"},
    billing=NULLABLE_OBJECT,
    rejection=NULLABLE_OBJECT,
    lease_renewals=COUNT,
    events={
        "type": "array",
        "items": obj(
            ["position", "stream_version", "occurred_at", "type", "payload"],
            position=INTEGER,
            stream_version=INTEGER,
            occurred_at=STRING,
            type=STRING,
            state_after=STRING,
            quota_effect={"type": "object"},
            payload={"type": "object"},
            note=STRING,
        ),
    },
    anomalies={"type": "array", "items": {"type": "object"}},
)
MODEL_LIST = obj(
    ["object", "data"],
    object=const("list"),
    data={
        "type": "array",
        "items": obj(
            ["id", "object", "created", "owned_by"],
            id=STRING,
            object=const("model"),
            created=INTEGER,
            owned_by=STRING,
        ),
    },
)
_USD = nullable({"type": "string", "pattern": r"^[0-9]+(\.[0-9]{1,6})?$"})
_LIMIT = nullable(integer(0, 10**12))
RUN_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}
RUN_CREATE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "id": {**nullable(RUN_ID_SCHEMA), "description": "default: a new run_ id"},
        "project": {**nullable(STRING), "description": "default: the calling key's project"},
        "max_calls": _LIMIT,
        "max_tool_calls": _LIMIT,
        "max_wall_seconds": nullable(integer(0, 10**9)),  # seconds: 10**12 ms
        "max_cost_usd": {
            "anyOf": [{"type": "string", "pattern": r"^[0-9]+(\.[0-9]{1,6})?$"},
                      {"type": "number", "minimum": 0}, {"type": "null"}],
        },
        "max_in_flight": _LIMIT,
    },
}
RUN = obj(
    ["id", "object", "project", "status", "started_at", "ended_at", "implicit", "limits", "usage",
     "exhausted"],
    id=STRING,
    object=const("run"),
    project=nullable(STRING),
    status={"type": "string", "enum": ["active", "exhausted", "ended"]},
    started_at={"type": "string", "format": "date-time"},
    ended_at=nullable({"type": "string", "format": "date-time"}),
    implicit={"type": "boolean"},
    limits=obj(
        ["max_calls", "max_tool_calls", "max_wall_seconds", "max_cost_usd", "max_in_flight"],
        max_calls=_LIMIT, max_tool_calls=_LIMIT, max_wall_seconds=nullable({"type": "number"}),
        max_cost_usd=_USD, max_in_flight=_LIMIT,
    ),
    usage=obj(
        ["calls", "in_flight", "tool_calls", "cost_usd", "reserved_usd"],
        calls=INTEGER, in_flight=INTEGER, tool_calls=INTEGER, cost_usd=_USD, reserved_usd=_USD,
    ),
    exhausted=nullable({
        "type": "string",
        "enum": ["calls", "tool_calls", "wall_clock", "cost", "in_flight", "ended"],
    }),
)  # fmt: skip
READINESS = obj(
    ["status", "problems", "warnings"],
    status={"type": "string", "enum": ["ready", "not_ready"]},
    problems={"type": "array", "items": STRING},
    warnings={"type": "array", "items": STRING},
)

# One server-sent event of a streamed completion (OpenAPI 3.1: the media type's schema describes
# each event): a chunk, an error object after a failure mid-stream, then `[DONE]`.
CHAT_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": const("message")},
    "if": {"properties": {"data": const("[DONE]")}},
    "else": {
        "properties": {
            "data": {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": {
                    "anyOf": [
                        ref("ChatCompletionChunk"),
                        obj(["error"], error=obj(["message"], message=STRING)),
                    ]
                },
            }
        }
    },
}

EPOCH = nullable(INTEGER)
FILE = obj(
    ["id", "object", "bytes", "created_at", "filename", "purpose"],
    id=STRING, object=const("file"), bytes=COUNT, created_at=INTEGER, filename=STRING,
    purpose={"enum": ["batch", "batch_output"]}, status=STRING, expires_at=EPOCH,
    status_details=nullable(STRING),
)
FILE_DELETED = obj(["id", "object", "deleted"], id=STRING, object=const("file"),
                   deleted=BOOLEAN)
BATCH = obj(
    ["id", "object", "endpoint", "input_file_id", "completion_window", "status", "created_at",
     "request_counts"],
    id=STRING, object=const("batch"), endpoint=STRING, errors=NULLABLE_OBJECT,
    input_file_id=STRING, completion_window=STRING,
    status={"enum": ["validating", "in_progress", "finalizing", "completed", "expired",
                     "cancelling", "cancelled", "failed"]},
    output_file_id=nullable(STRING), error_file_id=nullable(STRING), created_at=INTEGER,
    in_progress_at=EPOCH, expires_at=EPOCH, finalizing_at=EPOCH, completed_at=EPOCH,
    failed_at=EPOCH, expired_at=EPOCH, cancelling_at=EPOCH, cancelled_at=EPOCH,
    request_counts=obj(["total", "completed", "failed"], total=COUNT, completed=COUNT,
                       failed=COUNT),
    metadata=NULLABLE_OBJECT,
)
BATCH_LIST = obj(
    ["object", "data", "has_more"], object=const("list"),
    data={"type": "array", "items": ref("Batch")}, first_id=nullable(STRING),
    last_id=nullable(STRING), has_more=BOOLEAN,
)
BATCH_CREATE = obj(
    ["input_file_id", "endpoint", "completion_window"],
    input_file_id=STRING, endpoint=const("/v1/chat/completions"),
    completion_window={"type": "string", "description": "24h (and any window the server was "
                       "started with, e.g. 30s)"},
    metadata=METADATA,
)

SCHEMAS: dict[str, Any] = {
    "Error": ERROR,
    "ChatCompletionRequest": CHAT_REQUEST,
    "ChatCompletion": CHAT_COMPLETION,
    "ChatCompletionChunk": CHAT_CHUNK,
    "ChatCompletionEvent": CHAT_EVENT,
    "ModelList": MODEL_LIST,
    "UsageRow": USAGE_ROW,
    "LedgerEntry": LEDGER_ENTRY,
    "InvoiceLine": INVOICE_LINE,
    "Invoice": INVOICE,
    "Reconciliation": RECONCILIATION,
    "GoodputRow": GOODPUT_ROW,
    "Fleet": FLEET,
    "RequestTimeline": TIMELINE,
    "Readiness": READINESS,
    "RunCreate": RUN_CREATE,
    "Run": RUN,
    "File": FILE,
    "FileDeleted": FILE_DELETED,
    "Batch": BATCH,
    "BatchList": BATCH_LIST,
    "BatchCreateRequest": BATCH_CREATE,
}

# --- responses and parameters ------------------------------------------------------------------

REQUEST_ID_HEADER = {
    "X-Request-Id": {
        "description": "the request's id: the join key for support and finance",
        "schema": {"type": "string"},
        "required": True,
    }
}
RETRY_AFTER = {
    "Retry-After": {"description": "seconds", "schema": {"type": "string"}, "required": True}
}
ERROR_DESCRIPTIONS = {
    400: "invalid request: `param` names the field",
    401: "missing, unknown or revoked API key",
    403: "the key's scope may not call this (or read that tenant)",
    404: "not found (another tenant's data answers exactly like unknown data)",
    409: "a request with this Idempotency-Key is still in flight",
    413: "request body over the size limit",
    422: "Idempotency-Key reused with a different body",
    429: "a limit: the tenant's quota (type requests, tokens, concurrency; the message names "
    "the level of the hierarchy that refused), a spend budget (code budget_exceeded), a run's "
    "budget (code run_budget_exceeded), too many refused requests from this key, or too many "
    "failed authentications from this address",
    502: "the model replica failed before the first token",
    503: "no capacity (ours, not the tenant's quota)",
}


def error_response(status: int) -> dict[str, Any]:
    headers = dict(REQUEST_ID_HEADER)
    if status in (429, 503):
        headers.update(RETRY_AFTER)
    return {
        "description": ERROR_DESCRIPTIONS[status],
        "headers": headers,
        "content": {JSON: {"schema": ref("Error")}},
    }


def ok(schema: dict[str, Any], *, csv: bool = False, description: str = "OK") -> dict[str, Any]:
    body: dict[str, Any] = {JSON: {"schema": schema}}
    if csv:
        body["text/csv"] = {"schema": {"type": "string"}}
    return {"description": description, "headers": REQUEST_ID_HEADER, "content": body}


def rows(name: str) -> dict[str, Any]:
    return obj(["data"], data={"type": "array", "items": ref(name)})


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


def path(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": schema,
        "description": description,
    }


# Empty means "the default", as the web pages' forms send it.
INSTANT = {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "maxLength": 0}]}
TENANT_QUERY = query("tenant", STRING, "a tenant (finance keys; a customer key only its own)")
RANGE = [
    query(
        "from",
        INSTANT,
        "ISO 8601 instant, e.g. 2026-11-01T00:00:00Z (default: 30 days "
        "before `to`); the range is at most 366 days",
    ),
    query("to", INSTANT, "ISO 8601 instant (default: now)"),
]
MODEL_QUERY = query("model", STRING, "a model name or version")
FORMAT_QUERY = query("format", {"type": "string", "enum": ["json", "csv"]}, "default json")
AUTHENTICATED = [400, 401, 403, 429]
BEARER = [{"bearer": []}]

FILE_ID = path("file_id", STRING, "a file id")
BATCH_ID = path("batch_id", STRING, "a batch id")

OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/models", "get"): {
        "summary": "Models on sale",
        "responses": {"200": ok(ref("ModelList"))},
        "errors": [401, 403, 429],
    },
    ("/v1/billing/usage", "get"): {
        "summary": "Usage by hour, day, model or key",
        "parameters": [
            TENANT_QUERY,
            *RANGE,
            MODEL_QUERY,
            query(
                "group_by",
                {"type": "string",
                 "enum": ["hour", "day", "model", "key", "workspace", "project", "run"]},
                "default hour; key, workspace, project and run add that column (null: the "
                "organization's own, or outside any run)",
            ),
            FORMAT_QUERY,
        ],
        "responses": {"200": ok(rows("UsageRow"), csv=True)},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/billing/ledger", "get"): {
        "summary": "Billing ledger entries, oldest first",
        "parameters": [
            TENANT_QUERY,
            *RANGE,
            MODEL_QUERY,
            FORMAT_QUERY,
            query("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, "default 1000"),
            query("after", STRING, "the last request_id of the previous page"),
        ],
        "responses": {"200": ok(rows("LedgerEntry"), csv=True)},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/billing/invoices/{tenant}", "get"): {
        "summary": "A tenant's invoice for a calendar month",
        "parameters": [
            path("tenant", STRING, "the tenant"),
            query(
                "period",
                {"type": "string", "pattern": "^[0-9]{4}-(0[1-9]|1[0-2])$"},
                "YYYY-MM (default: this month)",
            ),
            FORMAT_QUERY,
        ],
        "responses": {"200": ok(ref("Invoice"), csv=True)},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/billing/reconciliation", "get"): {
        "summary": "Admitted vs ended vs refunded vs billed, with every mismatch (finance keys)",
        "parameters": RANGE,
        "responses": {"200": ok(ref("Reconciliation"))},
        "errors": AUTHENTICATED,
    },
    ("/v1/billing/goodput", "get"): {
        "summary": "Requests that ended in the range, by outcome against their tier's SLO",
        "parameters": [
            TENANT_QUERY,
            *RANGE,
            query(
                "group_by",
                {"type": "string", "pattern": GROUPS_PATTERN},
                "comma-separated subset of tenant, tier, model, hour (default tier)",
            ),
            FORMAT_QUERY,
        ],
        "responses": {"200": ok(rows("GoodputRow"), csv=True)},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/fleet", "get"): {
        "summary": "Every replica as the router sees it, and the autoscaling signal (admin keys)",
        "responses": {"200": ok(ref("Fleet"))},
        "errors": [*AUTHENTICATED, 503],
    },
    ("/v1/requests/{request_id}/events", "get"): {
        "summary": "A request's event timeline, re-folded (support keys; a customer its own)",
        "operationId": "get_request_events",
        "parameters": [
            path(
                "request_id",
                {"type": "string", "pattern": "^req_[0-9a-f]{32}$"},
                "the X-Request-Id of a response",
            )
        ],
        "responses": {"200": ok(ref("RequestTimeline"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/runs", "post"): {
        "summary": "Start an agent run with a budget (limits not given: the project's policy)",
        "requestBody": {"required": False, "content": {JSON: {"schema": ref("RunCreate")}}},
        "responses": {"200": ok(ref("Run"), description="the run, started")},
        "errors": [*AUTHENTICATED, 404, 409, 413],
    },
    ("/v1/runs/{run_id}", "get"): {
        "summary": "A run's budget, consumption and state (the caller's tenant's runs only)",
        "parameters": [path("run_id", RUN_ID_SCHEMA, "the run's id")],
        "responses": {"200": ok(ref("Run"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/runs/{run_id}/end", "post"): {
        "summary": "End a run: its later calls are refused (run_budget_exceeded, ended)",
        "parameters": [path("run_id", RUN_ID_SCHEMA, "the run's id")],
        "responses": {"200": ok(ref("Run"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/files", "post"): {
        "summary": "Upload a batch input file (JSONL, one request a line; at most 10 MiB and "
        "5,000 lines). A bad line is a 400 naming it; nothing is stored then",
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": obj(
                ["file", "purpose"], file={"type": "string", "format": "binary"},
                purpose=const("batch"),
            )}},
        },
        "responses": {"200": ok(ref("File"))},
        "errors": [*AUTHENTICATED, 413],
    },
    ("/v1/files/{file_id}", "get"): {
        "summary": "A file of the caller's tenant",
        "operationId": "retrieve_file",
        "parameters": [FILE_ID],
        "responses": {"200": ok(ref("File"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/files/{file_id}", "delete"): {
        "summary": "Delete a file and its content at once",
        "operationId": "delete_file",
        "parameters": [FILE_ID],
        "responses": {"200": ok(ref("FileDeleted"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/files/{file_id}/content", "get"): {
        "summary": "A file's content (an input file, or a batch's output or error file: one JSON "
        "object a line, keyed by custom_id)",
        "parameters": [FILE_ID],
        "responses": {"200": {"description": "JSONL", "headers": REQUEST_ID_HEADER,
                              "content": {"application/jsonl": {"schema": STRING}}}},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/batches", "post"): {
        "summary": "Create a batch: its items run in the flex class, billed at the flex price",
        "operationId": "create_batch",
        "requestBody": {"required": True,
                        "content": {JSON: {"schema": ref("BatchCreateRequest")}}},
        "responses": {"200": ok(ref("Batch"))},
        "errors": [*AUTHENTICATED, 404, 413],
    },
    ("/v1/batches", "get"): {
        "summary": "The caller's batches, newest first",
        "operationId": "list_batches",
        "parameters": [
            query("after", STRING, "the last batch id of the previous page"),
            query("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "default 20"),
        ],
        "responses": {"200": ok(ref("BatchList"))},
        "errors": AUTHENTICATED,
    },
    ("/v1/batches/{batch_id}", "get"): {
        "summary": "A batch, with its request counts and files",
        "parameters": [BATCH_ID],
        "responses": {"200": ok(ref("Batch"))},
        "errors": [*AUTHENTICATED, 404],
    },
    ("/v1/batches/{batch_id}/cancel", "post"): {
        "summary": "Cancel a batch: what runs stops (billed nothing), what completed stays billed",
        "parameters": [BATCH_ID],
        "responses": {"200": ok(ref("Batch"))},
        "errors": [*AUTHENTICATED, 404, 409],
    },
    ("/healthz", "get"): {
        "summary": "Liveness",
        "public": True,
        "responses": {
            "200": {
                "description": "alive",
                "content": {JSON: {"schema": obj(["status"], status=const("ok"))}},
            }
        },
    },
    ("/readyz", "get"): {
        "summary": "Readiness: folds healthy, control plane followed, a replica healthy",
        "public": True,
        "responses": {
            "200": {"description": "ready", "content": {JSON: {"schema": ref("Readiness")}}},
            "503": {"description": "not ready", "content": {JSON: {"schema": ref("Readiness")}}},
        },
    },
    ("/metrics", "get"): {
        "summary": "Prometheus metrics (with `--metrics-token`: `Authorization: Bearer <token>`)",
        "public": True,
        "errors": [401, 429],
        "responses": {
            "200": {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    },
}

CHAT_OPERATION: dict[str, Any] = {
    "summary": "Create a chat completion (OpenAI-compatible), streamed or not",
    "operationId": "create_chat_completion",
    "parameters": [
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[ -~]+$"},
            "description": "replays the finished request's response for 24 h (same body); 422 for "
            "a different body, 409 while the first is in flight",
        },
        {
            "name": "X-Tollgate-Run-Id",
            "in": "header",
            "required": False,
            "schema": RUN_ID_SCHEMA,
            "description": "the agent run the call belongs to (POST /v1/runs, or started by its "
            "first call under the project's run policy); a call past the run's budget is a 429 "
            "with code run_budget_exceeded naming the dimension",
        },
    ],
    "requestBody": {"required": True, "content": {JSON: {"schema": ref("ChatCompletionRequest")}}},
    "responses": {
        "200": {
            "description": "the completion, or with `stream: true` server-sent events: `data: "
            "<ChatCompletionChunk>` frames, then `data: [DONE]`; a failure after "
            "the first token is an error object frame, then `data: [DONE]`",
            "headers": REQUEST_ID_HEADER,
            "content": {
                JSON: {"schema": ref("ChatCompletion")},
                "text/event-stream": {"schema": ref("ChatCompletionEvent")},
            },
            "links": {
                "RequestEvents": {
                    "operationId": "get_request_events",
                    "parameters": {"request_id": "$response.header.X-Request-Id"},
                },
            },
        },
    },
    "errors": [400, 401, 403, 404, 409, 413, 422, 429, 502, 503],
}


def install(app: FastAPI, models: Callable[[], list[str]]) -> None:
    """Serve the full document at /openapi.json: FastAPI's paths with the operations above laid
    over them, and the completions route added. `models` (the models on sale now) gives the
    model field its examples and the request body its example, refreshed on every read."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        on_sale = models()
        document = app.openapi_schema
        model = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
        model["examples"] = on_sale
        body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][JSON]
        body["example"] = {
            "model": on_sale[0] if on_sale else "llama-3.1-8b",
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
        }
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        description="Tollgate: an OpenAI-compatible chat-completions API with exact, "
        "event-sourced billing. Authenticate with `Authorization: Bearer <key>`.",
        routes=app.routes,
    )
    paths = document["paths"]
    for (route, method), spec in OPERATIONS.items():
        operation = paths[route][method]  # KeyError: a described route that does not exist
        for key in ("parameters", "requestBody"):
            operation.pop(key, None)
        operation.update(_operation(spec))
    paths["/v1/chat/completions"] = {"post": _operation(CHAT_OPERATION)}
    components = document.setdefault("components", {})
    components["schemas"] = copy.deepcopy(SCHEMAS)
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _operation(spec: dict[str, Any]) -> dict[str, Any]:
    operation = {k: v for k, v in spec.items() if k not in {"errors", "public"}}
    responses = dict(spec["responses"])
    for status in spec.get("errors", ()):
        responses[str(status)] = error_response(status)
    operation["responses"] = responses
    if not spec.get("public"):
        operation["security"] = BEARER
    return operation
