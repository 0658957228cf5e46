"""The JSON schema of a chat-completions body's structured parts, stated from the same vocabulary
the checks in `chat_request.py` use (roles and their content parts, function names, image and
audio options): what /openapi.json publishes of a message, a content part, a tool call and a
named schema. `chat_request.FIELDS` puts these beside each field's check."""

from __future__ import annotations

import re
from typing import Any

# Matched whole (`fullmatch`): with `match`, `$` also matches before a final newline.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")

# Content part types by role: OpenAI's, plus the audio and video URLs vLLM takes from users.
PARTS_BY_ROLE: dict[str, frozenset[str]] = {
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "user": frozenset({"text", "image_url", "input_audio", "file", "audio_url", "video_url"}),
    "assistant": frozenset({"text", "refusal"}),
    "tool": frozenset({"text"}),
    "function": frozenset(),
}
# Roles whose `content` may not be null (the assistant's may, with tool calls; a function result's
# may, by the deprecated schema).
CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})
IMAGE_DETAILS = frozenset({"auto", "low", "high"})
AUDIO_FORMATS = frozenset({"wav", "mp3"})

STRING: dict[str, Any] = {"type": "string"}
BOOLEAN: dict[str, Any] = {"type": "boolean"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(required: list[str], **properties: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def const(value: str) -> dict[str, Any]:
    return {"type": "string", "const": value}


def enum_of(values: frozenset[str]) -> dict[str, Any]:
    return {"type": "string", "enum": sorted(values)}


def url_part(kind: str, **extra: Any) -> dict[str, Any]:
    return obj(["type", kind], type=const(kind), **{kind: obj(["url"], url=STRING, **extra)})


# What `_check_part` takes, by part type.
PART_SCHEMAS = {
    "text": obj(["type", "text"], type=const("text"), text=STRING),
    "refusal": obj(["type", "refusal"], type=const("refusal"), refusal=STRING),
    "image_url": url_part("image_url", detail=nullable(enum_of(IMAGE_DETAILS))),
    "input_audio": obj(
        ["type", "input_audio"], type=const("input_audio"),
        input_audio=obj(["data", "format"], data=STRING, format=enum_of(AUDIO_FORMATS)),
    ),
    "file": obj(["type", "file"], type=const("file"), file=obj(
        [], **dict.fromkeys(("file_data", "file_id", "filename"), nullable(STRING))
    )),
    "audio_url": url_part("audio_url"),
    "video_url": url_part("video_url"),
}  # fmt: skip
TOOL_CALL = obj(
    ["id", "function"], id=STRING, type=const("function"),
    function=obj(["name", "arguments"], name=STRING, arguments=STRING),
)  # fmt: skip


def message_schema(role: str) -> dict[str, Any]:
    """What `_check_message` takes from a message of `role` (by `PARTS_BY_ROLE` and
    `CONTENT_REQUIRED`)."""
    parts = sorted(PARTS_BY_ROLE[role])
    content: dict[str, Any] = STRING
    if parts:
        content = {"anyOf": [STRING, {"type": "array", "items": {
            "anyOf": [PART_SCHEMAS[p] for p in parts]
        }}]}  # fmt: skip
    required = ["role"]
    fields = {k: nullable(STRING) for k in ("name", "tool_call_id", "refusal")}
    if role in CONTENT_REQUIRED:
        required.append("content")
    else:
        content = nullable(content)
    if role == "tool":
        required.append("tool_call_id")
        fields["tool_call_id"] = STRING
    calls = nullable({"type": "array", "items": TOOL_CALL}) if role == "assistant" else {
        "type": "null"
    }
    schema = obj(required, role=const(role), content=content, **fields, tool_calls=calls)
    if role == "assistant":  # content unless tool calls (or a legacy function_call)
        schema["anyOf"] = [
            {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
            {"required": ["tool_calls"],
             "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            {"required": ["function_call"],
             "properties": {"function_call": {"not": {"type": "null"}}}},
        ]  # fmt: skip
    return schema


def named_schema(schema_key: str) -> dict[str, Any]:
    """`_checknamed_schema`'s."""
    return obj(
        ["name"], name={"type": "string", "pattern": f"^{FUNCTION_NAME.pattern}$"},
        description=nullable(STRING), strict=nullable(BOOLEAN),
        **{schema_key: nullable({"type": "object"})},
    )  # fmt: skip
