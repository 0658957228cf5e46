"""The Batch API's files: the input file's format (`parse_input`) and the output and error
files' lines. Prompts and completions never enter an event: they live in the files
(`ledger/batches.py`), which are deleted after a stated retention.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from tollgate_llm.domain.batches.state import ENDPOINTS
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.text import check_header_value, check_text, has_surrogate, is_header_value
from tollgate_llm.domain.text import check_metadata as _check_metadata

# Bounds on what is stored: a file of prompts is kept in the database until its batch ends.
MAX_FILE_BYTES: Final = 10 * 1024 * 1024
MAX_LINES: Final = 5_000
MAX_CUSTOM_ID_CHARS: Final = 64
MAX_NESTING: Final = 66  # the chat body's 64 levels, below the line object and its body
# The chat route's bound on `model` (api/services/chat_request.py): the read models' columns are
# 200 wide.
MAX_MODEL_CHARS: Final = 200
# What the runner can send (streams/batch_runner.py): the body goes out through orjson, which
# writes integers from -2**63 to 2**64 - 1 and nothing wider, and no non-finite float (it writes
# NaN and Infinity as null, a silent change of the request).
INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**64 - 1
# How long files are kept: an input file for this long after its batch ended (or after upload,
# when no batch uses it); output and error files for this long after they were written.
INPUT_RETENTION_S: Final = 24 * 3600
OUTPUT_RETENTION_S: Final = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a batch file: its 1-based line number, identity and chat body."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input(content: bytes) -> list[InputLine]:
    """Every request of a batch file, or a DomainError naming the first bad line (its `field` is
    `line N` and the rule). What the chat endpoint itself would refuse in a body (a bad
    parameter, an unknown model) is not checked here: that item fails alone, into the error
    file, while the others run."""
    if len(content) > MAX_FILE_BYTES:
        raise DomainError("file_too_large", f"a batch file holds at most {MAX_FILE_BYTES} bytes")
    lines: list[InputLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_LINES:
            raise DomainError("too_many_lines", f"a batch file holds at most {MAX_LINES} requests")
        item = _line(number, raw)
        if item.custom_id in seen:
            raise _bad(
                number, "duplicate_custom_id", "custom_id is used by an earlier line", "custom_id"
            )
        seen.add(item.custom_id)
        lines.append(item)
    if not lines:
        raise DomainError("empty_file", "the batch file holds no request")
    return lines


class _Unsendable(ValueError):
    """A JSON number the runner could not send back as it was written."""


def _int(text: str) -> int:
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise _Unsendable("an integer outside [-2^63, 2^64 - 1]")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unsendable("a number too large for a double")
    return value


def _constant(text: str) -> float:
    raise _Unsendable(f"{text}, which is not JSON")


def _line(number: int, raw: bytes) -> InputLine:
    try:
        obj = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except _Unsendable:
        # Where: the same line parsed again without the hooks, then walked (rare: a bad line).
        raise _unsendable_number(number, raw) from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        # Never the text: a line is a prompt.
        raise _bad(number, "invalid_json", "is not valid JSON") from None
    if _too_deep(obj, MAX_NESTING):
        raise _bad(number, "too_nested", f"nests more than {MAX_NESTING} levels")
    if not isinstance(obj, dict):
        raise _bad(number, "invalid_json", "must be a JSON object")
    custom_id = obj.get("custom_id")
    # The runner sends it in a header (X-Tollgate-Batch-Item) and it is recorded in the batch's
    # stream and its results: printable ASCII, or the item could never be sent.
    try:
        check_header_value(custom_id, "custom_id", max_chars=MAX_CUSTOM_ID_CHARS)
    except DomainError:
        raise _bad(
            number, "invalid_custom_id",
            f"custom_id must be 1 to {MAX_CUSTOM_ID_CHARS} printable ASCII characters "
            "(U+0020-U+007E) without a space at either end", "custom_id",
        ) from None
    assert isinstance(custom_id, str)
    if obj.get("method") != "POST":
        raise _bad(number, "invalid_method", "method must be POST", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise _bad(
            number, "invalid_url", f"url must be one of {', '.join(sorted(ENDPOINTS))}", "url"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _bad(number, "invalid_body", "body must be a JSON object", "body")
    if body.get("stream") is True:
        raise _bad(number, "stream_unsupported", "body.stream must not be true in a batch",
                   "body.stream")
    # The model is recorded when the edge refuses it, and counted by name in the queue's
    # metrics; a missing one is the item's own 400, in the error file.
    if "model" in body:
        try:
            check_text(body["model"], "body.model", max_chars=MAX_MODEL_CHARS)
        except DomainError as exc:
            raise _bad(number, "invalid_model", exc.message.replace("'", ""), "body.model") \
                from None
    where = _unsendable_string(body, "body")
    if where is not None:
        raise _bad(number, "unsendable_text",
                   f"{where} holds a lone surrogate (U+D800-U+DFFF), which cannot be sent", where)
    return InputLine(number, str(custom_id), str(url), body)


def _unsendable_number(number: int, raw: bytes) -> DomainError:
    obj = json.loads(raw)
    where = _find(obj, "", lambda v: (
        isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= INT_MAX
    ) or (isinstance(v, float) and not math.isfinite(v)))
    field = (where or "").lstrip(".") or "body"
    return _bad(
        number, "unsendable_number",
        f"{field} is a number that cannot be sent as written (integers from -2^63 to 2^64 - 1, "
        "finite numbers, no NaN or Infinity)", field,
    )


def _unsendable_string(value: Any, path: str) -> str | None:
    """The path of the first string (a key names its object) with a lone surrogate, or None.
    NUL and every other code point are sent and billed as the prompt they are: only a lone
    surrogate cannot be encoded."""
    return _find(value, path, lambda v: isinstance(v, str) and has_surrogate(v))


def _find(value: Any, path: str, bad: Callable[[Any], bool]) -> str | None:
    """The path (`.key`, `[i]`) of the first value below `value` that is `bad` (a dict whose key
    is bad is named itself)."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if bad(key):
                    return where
                # The path is shown and may be recorded (a failed batch's message): a key is
                # named only when it is a plain one, never as arbitrary client text.
                name = key if len(key) <= 64 and is_header_value(key) else "?"
                stack.append((child, f"{where}.{name}"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
        elif bad(item):
            return where
    return None


def _too_deep(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` levels (the chat endpoint's own bound)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in item)
    return False


def _bad(number: int, rule: str, message: str, field: str = "") -> DomainError:
    """A bad line, its `field` `line N: <field>` (`line N` for the line as a whole)."""
    where = f"line {number}: {field}" if field else f"line {number}"
    return DomainError(rule, f"line {number}: {message}", field=where)


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata (`domain.text.check_metadata`): at most 16 string pairs, keys ≤ 64 and
    values ≤ 512 characters, each storable; the DomainError names `metadata` or `metadata.<key>`."""
    return _check_metadata(metadata)


# --- the output and error files -------------------------------------------------------------------


def output_line(custom_id: str, request_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape."""
    return {
        "id": "batch_req_" + request_id.removeprefix("req_"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def unrun_line(custom_id: str, outcome: str) -> dict[str, Any]:
    """The error-file line of an item the batch ended before running (expired or cancelled)."""
    code = "batch_expired" if outcome == "expired" else "batch_cancelled"
    message = (
        "This request could not be executed before the completion window expired."
        if outcome == "expired" else "This request was not executed: the batch was cancelled."
    )
    return {"id": None, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
