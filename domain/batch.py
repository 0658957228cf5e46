"""The Batch API in the pure model: the input file's format, and the batch stream
(stream_id = "batch-<batch id>") — its events, state, `decide` and `evolve`.

A batch's items run as flex requests with their own request streams; the batch stream records
only which item ended how (by `custom_id`, with the request id that served it), so support can
replay an item by its request id and an item is recorded at most once whatever is retried.
Prompts and completions never enter an event: they live in the files (`ledger/batches.py`),
which are deleted after a stated retention.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Final

from domain.errors import DomainError
from domain.events import (
    BatchCancelRequested,
    BatchCreated,
    BatchEnded,
    BatchFailed,
    BatchFinalizing,
    BatchItemFinished,
    BatchStarted,
    Event,
    Recorded,
)
from domain.text import check_header_value, check_text, has_surrogate, is_header_value
from domain.text import check_metadata as _check_metadata

BATCH_PREFIX: Final = "batch-"
ENDPOINT: Final = "/v1/chat/completions"
ENDPOINTS: Final = frozenset({ENDPOINT})
# OpenAI's only window. Shorter ones ("30s", "5m") exist only when the server is started with
# them (tests, demos): `window_seconds(text, extra)`.
WINDOWS_S: Final = {"24h": 86_400}
WINDOW_PATTERN: Final = re.compile(r"([1-9][0-9]{0,4})([smh])")

# Bounds on what is stored: a file of prompts is kept in the database until its batch ends.
MAX_FILE_BYTES: Final = 10 * 1024 * 1024
MAX_LINES: Final = 5_000
MAX_CUSTOM_ID_CHARS: Final = 64
MAX_NESTING: Final = 66  # the chat body's 64 levels, below the line object and its body
# The chat route's bound on `model` (api/chat_request.py): the read models' columns are 200 wide.
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

STATUSES: Final = (
    "validating", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled",
    "failed",
)
ENDED: Final = frozenset({"completed", "expired", "cancelled", "failed"})


def batch_stream(batch_id: str) -> str:
    return BATCH_PREFIX + batch_id


def window_seconds(text: Any, extra: Iterable[str] = ()) -> int | None:
    """The completion window in seconds, or None if it is not one this server offers."""
    if not isinstance(text, str):
        return None
    if text in WINDOWS_S:
        return WINDOWS_S[text]
    if text not in extra:
        return None
    found = WINDOW_PATTERN.fullmatch(text)
    if found is None:
        return None
    return int(found[1]) * {"s": 1, "m": 60, "h": 3600}[found[2]]


# --- the input file -----------------------------------------------------------------------------


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


# --- state --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchState:
    batch_id: str = ""
    status: str = "new"
    tenant_id: str = ""
    key_id: str = ""
    input_file_id: str = ""
    endpoint: str = ""
    completion_window: str = ""
    metadata_json: str = "{}"
    total: int = 0
    completed: int = 0
    failed: int = 0
    finished: frozenset[str] = frozenset()  # custom ids with an outcome
    finalizing_as: str = ""  # completed | expired, once finalizing
    output_file_id: str | None = None
    error_file_id: str | None = None
    error_code: str = ""
    error_message: str = ""
    created_at: datetime | None = None
    expires_at: datetime | None = None
    in_progress_at: datetime | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    expired_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None
    version: int = 0

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def all_finished(self) -> bool:
        return self.completed + self.failed >= self.total


# --- commands -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateBatch:
    batch_id: str
    tenant_id: str
    key_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: int
    total: int
    now: datetime
    metadata_json: str = "{}"


@dataclass(frozen=True, slots=True)
class StartBatch:
    pass


@dataclass(frozen=True, slots=True)
class RecordItem:
    custom_id: str
    request_id: str
    outcome: str  # completed | failed
    status_code: int


@dataclass(frozen=True, slots=True)
class CancelBatch:
    pass


@dataclass(frozen=True, slots=True)
class FinalizeBatch:
    """All items have an outcome (completed), or the window passed (expired)."""

    outcome: str


@dataclass(frozen=True, slots=True)
class EndBatch:
    """The output and error files are written: the batch ends as it was finalizing or
    cancelling."""

    output_file_id: str | None
    error_file_id: str | None


@dataclass(frozen=True, slots=True)
class FailBatch:
    code: str
    message: str


BatchCommand = (
    CreateBatch | StartBatch | RecordItem | CancelBatch | FinalizeBatch | EndBatch | FailBatch
)


def decide(state: BatchState, command: BatchCommand) -> tuple[Event, ...]:
    """The facts a command produces, () when it changes nothing (a repeat), or a DomainError."""
    match command:
        case CreateBatch():
            if state.status != "new":
                return ()  # the same batch id created again: what was recorded stands
            if command.endpoint not in ENDPOINTS:
                raise DomainError("bad_endpoint", f"endpoint must be one of {sorted(ENDPOINTS)}",
                                  field="endpoint")
            if command.window_s <= 0:
                raise DomainError("bad_window", "the completion window must be positive",
                                  field="completion_window")
            if not 1 <= command.total <= MAX_LINES:
                raise DomainError("bad_total", "a batch holds 1 to 5,000 requests")
            return (
                BatchCreated(
                    command.batch_id, command.tenant_id, command.key_id, command.input_file_id,
                    command.endpoint, command.completion_window, command.total,
                    command.now + timedelta(seconds=command.window_s), command.metadata_json,
                ),
            )
        case StartBatch():
            _require(state)
            return (BatchStarted(state.batch_id),) if state.status == "validating" else ()
        case RecordItem():
            _require(state)
            if command.outcome not in ("completed", "failed"):
                raise DomainError("bad_outcome", f"item outcome {command.outcome!r}")
            if command.custom_id in state.finished or state.ended:
                return ()  # an item ends once: a retry that raced it changes nothing
            if state.status not in ("in_progress", "cancelling", "finalizing"):
                raise DomainError("not_running", f"the batch is {state.status}")
            return (
                BatchItemFinished(state.batch_id, command.custom_id, command.request_id,
                                  command.outcome, command.status_code),
            )
        case CancelBatch():
            _require(state)
            if state.status in ("validating", "in_progress"):
                return (BatchCancelRequested(state.batch_id),)
            if state.status in ("cancelling", "cancelled"):
                return ()
            raise DomainError("not_cancellable", f"a {state.status} batch cannot be cancelled",
                              field="batch_id")
        case FinalizeBatch():
            _require(state)
            if state.status == "finalizing" or state.ended or state.status == "cancelling":
                return ()
            if command.outcome == "completed" and not state.all_finished:
                raise DomainError("items_left", "items without an outcome remain")
            if command.outcome not in ("completed", "expired"):
                raise DomainError("bad_outcome", f"finalizing as {command.outcome!r}")
            return (BatchFinalizing(state.batch_id, command.outcome),)
        case EndBatch():
            _require(state)
            if state.ended:
                return ()
            if state.status == "cancelling":
                outcome = "cancelled"
            elif state.status == "finalizing":
                outcome = state.finalizing_as
            else:
                raise DomainError("not_finalizing", f"a {state.status} batch is not ending")
            return (BatchEnded(state.batch_id, outcome, command.output_file_id,
                               command.error_file_id),)
        case FailBatch():
            _require(state)
            if state.ended:
                return ()
            return (BatchFailed(state.batch_id, command.code, command.message[:300]),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


def _require(state: BatchState) -> None:
    if state.status == "new":
        raise DomainError("unknown_batch", "no such batch", field="batch_id")


# --- evolve -------------------------------------------------------------------------------------


def evolve(state: BatchState, recorded: Recorded) -> BatchState:
    """Apply one recorded fact (a redelivered one, stream_version ≤ version, changes nothing)."""
    if recorded.stream_version <= state.version:
        return state
    event, at = recorded.event, recorded.occurred_at
    step = _EVOLVERS.get(type(event))
    if step is None:
        raise DomainError("unknown_event", f"{recorded.type} does not belong to a batch stream")
    return replace(step(state, event, at), version=recorded.stream_version)


def _created(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(
        state, batch_id=e.batch_id, status="validating", tenant_id=e.tenant_id,
        key_id=e.key_id, input_file_id=e.input_file_id, endpoint=e.endpoint,
        completion_window=e.completion_window, total=e.total, metadata_json=e.metadata_json,
        created_at=at, expires_at=e.expires_at,
    )


def _started(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="in_progress", in_progress_at=at)


def _item(state: BatchState, e: Any, at: datetime) -> BatchState:
    if e.custom_id in state.finished:
        raise DomainError("item_twice", f"item {e.custom_id!r} ended twice")
    done = e.outcome == "completed"
    return replace(
        state, finished=state.finished | {e.custom_id},
        completed=state.completed + done, failed=state.failed + (not done),
    )


def _cancelling(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="cancelling", cancelling_at=at)


def _finalizing(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="finalizing", finalizing_at=at, finalizing_as=e.outcome)


def _ended(state: BatchState, e: Any, at: datetime) -> BatchState:
    ended = replace(state, status=e.outcome, output_file_id=e.output_file_id,
                    error_file_id=e.error_file_id)
    if e.outcome == "completed":
        return replace(ended, completed_at=at)
    if e.outcome == "expired":
        return replace(ended, expired_at=at)
    return replace(ended, cancelled_at=at)


def _failed(state: BatchState, e: Any, at: datetime) -> BatchState:
    return replace(state, status="failed", failed_at=at, error_code=e.code,
                   error_message=e.message)


_EVOLVERS: Final[dict[type, Callable[[BatchState, Any, datetime], BatchState]]] = {
    BatchCreated: _created,
    BatchStarted: _started,
    BatchItemFinished: _item,
    BatchCancelRequested: _cancelling,
    BatchFinalizing: _finalizing,
    BatchEnded: _ended,
    BatchFailed: _failed,
}


def fold(records: Iterable[Recorded], state: BatchState | None = None) -> BatchState:
    state = state or BatchState()
    for recorded in records:
        state = evolve(state, recorded)
    return state


# --- the output and error files -----------------------------------------------------------------


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
