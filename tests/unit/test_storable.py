"""Nothing a client or an operator sends reaches storage unless every backend can store it
(DESIGN.md invariant 12): the one check (domain/text.py) and each door that applies it — the chat
body, the batch file's lines, the control-plane commands — refusing with the field named and
never the value."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from tests import builders as tb
from tests.unit.test_budgets import tree
from tollgate_llm.api.services.auth import single_authorization
from tollgate_llm.api.services.chat_request import parse_chat_request
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain import text
from tollgate_llm.domain.batches.files import check_metadata, parse_input
from tollgate_llm.domain.control_plane.decide import (
    RegisterTenant,
    SetFlexDiscount,
    SetPrice,
    decide_control,
)
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.decide import CreateProject, CreateWorkspace, StartRun
from tollgate_llm.domain.runs.state import RunLimits

NUL = "\x00"
SURROGATE = "\ud800"


# --- the check ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["a\x00b", NUL, "\ud800", "x\udfff", "\udc00y"],
)
def test_nul_and_lone_surrogates_are_unstorable(value: str) -> None:
    assert text.unstorable(value) is not None
    with pytest.raises(DomainError) as err:
        text.check_text(value, "model", max_chars=200)
    assert err.value.rule == "unstorable_text" and err.value.field == "model"
    assert value not in err.value.message


@pytest.mark.parametrize(
    "value",
    ["llama", "\x01\x1f\x7f\x85", "\ufffe\uffff\ufdd0", "\U0010ffff", "é😀", "\ue000", "a\nb"],
)
def test_every_other_code_point_is_storable(value: str) -> None:
    # Controls, noncharacters, private use and astral code points are valid UTF-8 that
    # PostgreSQL, SQLite and JSON all hold: refusing them is a field's own rule, not this one.
    assert text.unstorable(value) is None
    assert text.check_text(value, "f", max_chars=10) == value
    value.encode("utf-8")  # what every backend's driver does first


def test_check_text_bounds_length_and_type() -> None:
    with pytest.raises(DomainError) as err:
        text.check_text("x" * 11, "f", max_chars=10)
    assert err.value.rule == "string_above_max_length"
    with pytest.raises(DomainError) as err:
        text.check_text("", "f", max_chars=10)
    assert err.value.rule == "string_too_short"
    with pytest.raises(DomainError) as err:
        text.check_text(5, "f", max_chars=10)
    assert err.value.rule == "invalid_type"
    assert text.check_text("", "f", max_chars=10, min_chars=0) == ""


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("item-1", True),
        ("a b", True),
        ("x\ny", False),
        ("x\ry", False),
        ("x\ty", False),
        ("é", False),
        (" a", False),
        ("a ", False),
        ("a\x7f", False),
        ("a" + SURROGATE, False),
    ],
)
def test_a_header_value_is_printable_ascii_without_edge_spaces(value: str, ok: bool) -> None:
    assert text.is_header_value(value) is ok


def test_metadata_names_the_key_when_it_can() -> None:
    assert text.check_metadata({"a": "b"}) == {"a": "b"}
    assert text.check_metadata(None) == {}
    with pytest.raises(DomainError) as err:
        text.check_metadata({"foo": "a\x00b"})
    assert err.value.field == "metadata.foo"
    with pytest.raises(DomainError) as err:
        text.check_metadata({"f\x00o": "b"})
    assert err.value.field == "metadata" and NUL not in err.value.message
    with pytest.raises(DomainError) as err:
        text.check_metadata({str(i): "v" for i in range(17)})
    assert err.value.field == "metadata"
    with pytest.raises(DomainError) as err:
        text.check_metadata({"k": "v" * 513})
    assert err.value.field == "metadata.k"
    with pytest.raises(DomainError) as err:
        text.check_metadata({"k": 5})
    assert err.value.field == "metadata.k"


# --- the chat body ------------------------------------------------------------------------------


def chat(**fields: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    ).encode()


def chat_refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_chat_request(raw)
    assert err.value.status == 400
    assert NUL not in err.value.message and NUL not in (err.value.param or "")
    return err.value


TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": "a\x00b"}, "model"),
        ({"user": "u\x00"}, "user"),
        ({"metadata": {"foo": "a\x00b"}}, "metadata.foo"),
        ({"metadata": {"f\x00o": "b"}}, "metadata"),
        ({"metadata": "x"}, "metadata"),
        # Issue 27 item 8: `$` matched before a final newline.
        (
            {"tools": [{**TOOL, "function": {**TOOL["function"], "name": "get\n"}}]},
            "tools[0].function.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "out\n"}}},
            "response_format.json_schema.name",
        ),
    ],
)
def test_an_unstorable_or_malformed_chat_field_is_a_400_naming_it(
    fields: dict[str, Any], param: str
) -> None:
    assert chat_refused(chat(**fields)).param == param


def test_a_storable_chat_body_with_metadata_and_user_is_accepted() -> None:
    req = parse_chat_request(chat(user="u-1", metadata={"team": "search"}, tools=[TOOL]))
    assert req.model == "m" and "metadata" not in req.upstream and "user" not in req.upstream


# --- the batch file -----------------------------------------------------------------------------


def line(custom_id: Any = "a", **overrides: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]},
        **overrides,
    }


def batch_refused(raw: bytes) -> DomainError:
    with pytest.raises(DomainError) as err:
        parse_input(raw)
    assert "secret prompt" not in err.value.message
    assert NUL not in err.value.message
    return err.value


def two_lines(second: str) -> bytes:
    """A good first line, then `second` (raw JSON text, so escapes reach the parser as sent)."""
    return json.dumps(line("ok")).encode() + b"\n" + second.encode("utf-8", "surrogatepass")


BODY = '"body": {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]}'
HEAD = '"method": "POST", "url": "/v1/chat/completions"'


@pytest.mark.parametrize(
    ("second", "field"),
    [
        # Issue 27 item 2: each of these passed the upload and never finished.
        ('{"custom_id": "x\\ny", ' + HEAD + ", " + BODY + "}", "line 2: custom_id"),
        ('{"custom_id": "x\\u0000y", ' + HEAD + ", " + BODY + "}", "line 2: custom_id"),
        ('{"custom_id": "caf\\u00e9", ' + HEAD + ", " + BODY + "}", "line 2: custom_id"),
        ('{"custom_id": "\\ud800", ' + HEAD + ", " + BODY + "}", "line 2: custom_id"),
        (
            '{"custom_id": "ok2", '
            + HEAD
            + ', "body": {"model": "m", "seed": 18446744073709551616,'
            ' "messages": []}}',
            "line 2: body.seed",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "m", "messages": '
            '[{"role": "user", "content": "\\udc00"}]}}',
            "line 2: body.messages[0].content",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "m", "\\ud800": 1, '
            '"messages": []}}',
            "line 2: body",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "m", "temperature": NaN, '
            '"messages": []}}',
            "line 2: body.temperature",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "m", "temperature": 1e999, '
            '"messages": []}}',
            "line 2: body.temperature",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "a\\u0000b", "messages": []}}',
            "line 2: body.model",
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": "m", "x\\u0000": [1e999], '
            '"messages": []}}',
            "line 2: body.?[0]",  # a key is named only when it is plain text
        ),
        (
            '{"custom_id": "ok2", ' + HEAD + ', "body": {"model": 5, "messages": []}}',
            "line 2: body.model",
        ),
    ],
)
def test_a_line_the_runner_could_not_send_or_the_store_hold_is_refused(
    second: str, field: str
) -> None:
    err = batch_refused(two_lines(second))
    assert err.field == field, err.message
    assert err.message.startswith("line 2: ")


def test_a_line_with_64_bit_numbers_and_any_prompt_text_is_accepted() -> None:
    body = {
        "model": "m",
        "seed": 2**64 - 1,
        "logit_bias": {"1": -(2**63)},
        "messages": [{"role": "user", "content": "a\x00b \x01 é 😀"}],
    }
    lines = parse_input(json.dumps(line("item-1", body=body)).encode())
    assert lines[0].body == body


def test_batch_metadata_is_checked_like_the_chat_metadata() -> None:
    with pytest.raises(DomainError) as err:
        check_metadata({"k": "a\x00"})
    assert err.value.field == "metadata.k"


# --- identifiers of the control plane (the CLI's inputs) ----------------------------------------


def refused_control(view: ControlView, command: Any) -> DomainError:
    with pytest.raises(DomainError) as err:
        decide_control(view, command)
    return err.value


def test_a_tenant_name_ending_in_a_newline_is_refused() -> None:
    assert refused_control(ControlView(), RegisterTenant("acme\n", "free", "s")).field == "name"


@pytest.mark.parametrize(
    "command",
    [
        StartRun(tb.TENANT, "run-1\n", None, RunLimits()),
        CreateWorkspace(tb.TENANT, "ops\n"),
        CreateProject(tb.TENANT, "bot\n", "research"),
    ],
)
def test_a_run_id_or_level_name_ending_in_a_newline_is_refused(command: Any) -> None:
    err = refused_control(tree().view, command)
    assert err.rule in ("bad_run_id", "bad_name")


@pytest.mark.parametrize("model", ["a\x00b", "x" * 194, "m" + SURROGATE])
def test_an_unstorable_model_name_in_a_control_command_is_refused(model: str) -> None:
    now = tb.at(0)
    assert refused_control(ControlView(), SetPrice(model, 1, 1, 1, now, now)).field == "model"
    discount = SetFlexDiscount(model, 1, now + timedelta(seconds=1), now)
    assert refused_control(ControlView(), discount).field == "model"


# --- one Authorization header -------------------------------------------------------------------


def test_two_authorization_headers_are_refused() -> None:
    one = [(b"host", b"x"), (b"authorization", b"Bearer a")]
    assert single_authorization(one) is None
    two = [*one, (b"authorization", b"Bearer b")]
    err = single_authorization(two)
    assert err is not None and err.status == 400 and err.param == "Authorization"
    assert "Bearer" not in err.message
