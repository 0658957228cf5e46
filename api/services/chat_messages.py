"""The chat body's `messages`, checked item by item (`parse_chat_request` calls
`check_messages`): roles, content parts per role, tool calls. A broken rule is raised as `Bad`,
named relative to its item, and the loop that knows the item's index names the whole field, so
that the ordinary path formats no strings. The body's other fields are checked in
chat_request.py, which uses `Bad`, `need` and `one_of` for their own nested items too.
"""

from __future__ import annotations

from typing import Any

from tollgate_llm.api.services.chat_schema import (
    AUDIO_FORMATS,
    CONTENT_REQUIRED,
    IMAGE_DETAILS,
    PARTS_BY_ROLE,
)
from tollgate_llm.api.services.errors import ApiError, bad_request

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class Bad(Exception):
    """A rule broken inside an array item, named relative to it (".type", "" for the item): the
    loop that knows the item's index names the full field, so the ordinary path formats no
    strings."""

    def __init__(self, where: str, rule: str, code: str = "invalid_value") -> None:
        self.where, self.rule, self.code = where, rule, code

    def at(self, prefix: str) -> ApiError:
        param = prefix + self.where
        return bad_request(f"'{param}' {self.rule}", param, code=self.code)


def check_messages(messages: list[Any]) -> None:
    for i, message in enumerate(messages):
        try:
            _check_message(message)
        except Bad as bad:
            raise bad.at(f"messages[{i}]") from None


def _check_message(message: Any) -> None:
    if type(message) is not dict:
        raise Bad("", "must be an object", "invalid_type")
    role = message.get("role")
    if not one_of(role, ROLES):
        if role is None:
            raise Bad(".role", "is required", "missing_required_parameter")
        raise Bad(".role", f"must be one of {', '.join(sorted(ROLES))}")
    content = message.get("content")
    if type(content) is str:
        pass
    elif type(content) is list:
        allowed = PARTS_BY_ROLE[role]
        if not allowed:
            raise Bad(".content", "must be a string", "invalid_type")
        for j, part in enumerate(content):
            try:
                _check_part(part, allowed, role)
            except Bad as bad:
                raise Bad(f".content[{j}]{bad.where}", bad.rule, bad.code) from None
    elif content is None:
        if role in CONTENT_REQUIRED:
            raise Bad(".content", "is required", "missing_required_parameter")
        if (
            role == "assistant"
            and not message.get("tool_calls")
            and message.get("function_call") is None
        ):
            raise Bad(
                ".content", "is required unless tool_calls is given", "missing_required_parameter"
            )
    else:
        raise Bad(".content", "must be a string or an array of content parts", "invalid_type")
    # Role and content are all an ordinary message has.
    if len(message) > 2 or content is None or role == "tool":
        _check_message_extras(message, role)


def _check_part(part: Any, allowed: frozenset[str], role: str) -> None:
    if type(part) is not dict:
        raise Bad("", "must be an object", "invalid_type")
    kind = part.get("type")
    if not one_of(kind, allowed):
        raise Bad(".type", f"must be one of {', '.join(sorted(allowed))} in a {role} message")
    if kind == "text" or kind == "refusal":
        need(part, kind, str, "a string")
    elif kind == "input_audio":
        audio = need(part, "input_audio", dict, "an object")
        need(audio, "data", str, "a string", ".input_audio")
        if not one_of(audio.get("format"), AUDIO_FORMATS):
            raise Bad(".input_audio.format", "must be wav or mp3")
    elif kind == "file":
        file = need(part, "file", dict, "an object")
        for key in ("file_data", "file_id", "filename"):
            if file.get(key) is not None and type(file[key]) is not str:
                raise Bad(f".file.{key}", "must be a string", "invalid_type")
    else:  # image_url, audio_url, video_url: {"type": T, T: {"url": ..., ...}}
        target = need(part, kind, dict, "an object")
        need(target, "url", str, "a string", "." + kind)
        detail = target.get("detail")
        if kind == "image_url" and detail is not None and not one_of(detail, IMAGE_DETAILS):
            raise Bad(".image_url.detail", "must be auto, low or high")


def _check_message_extras(message: dict[str, Any], role: str) -> None:
    for key in ("name", "tool_call_id", "refusal"):
        value = message.get(key)
        if value is not None and type(value) is not str:
            raise Bad("." + key, "must be a string", "invalid_type")
    if role == "tool" and message.get("tool_call_id") is None:
        raise Bad(".tool_call_id", "is required", "missing_required_parameter")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if role != "assistant":
        raise Bad(".tool_calls", "is only allowed in assistant messages")
    if type(calls) is not list:
        raise Bad(".tool_calls", "must be an array", "invalid_type")
    for j, call in enumerate(calls):
        try:
            if type(call) is not dict:
                raise Bad("", "must be an object", "invalid_type")
            need(call, "id", str, "a string")
            if call.get("type", "function") != "function":
                raise Bad(".type", "must be function")
            function = need(call, "function", dict, "an object")
            need(function, "name", str, "a string", ".function")
            need(function, "arguments", str, "a string", ".function")
        except Bad as bad:
            raise Bad(f".tool_calls[{j}]{bad.where}", bad.rule, bad.code) from None


def need(obj: dict[str, Any], key: str, kind: type, expected: str, where: str = "") -> Any:
    value = obj.get(key)
    if type(value) is not kind:
        if value is None:
            raise Bad(f"{where}.{key}", "is required", "missing_required_parameter")
        raise Bad(f"{where}.{key}", f"must be {expected}", "invalid_type")
    return value


def one_of(value: Any, allowed: frozenset[str]) -> bool:
    # The type test first: a list or an object is unhashable, and `in` would raise.
    return type(value) is str and value in allowed
