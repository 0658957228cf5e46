"""The Files and Batch API as an application service: what the routes ask, in OpenAI's shapes.

The rules (the file format, the batch's states) are `domain.batches`'s; a batch's facts go through
the command handler into its stream; the stored content (`ledger/batches.py`) is read only for
its own tenant. The batch runner (streams/batch_runner.py) does the rest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import orjson

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.errors import ApiError, bad_request
from tollgate_llm.domain.batches.decide import BatchCommand, CancelBatch, CreateBatch, decide
from tollgate_llm.domain.batches.evolve import fold
from tollgate_llm.domain.batches.files import INPUT_RETENTION_S, check_metadata, parse_input
from tollgate_llm.domain.batches.state import (
    ENDPOINTS,
    WINDOWS_S,
    BatchState,
    batch_stream,
    window_seconds,
)
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.text import check_text, unstorable
from tollgate_llm.ledger.batches import BatchStore, StoredFile
from tollgate_llm.ledger.commands import CommandHandler, batch_stream_loader
from tollgate_llm.ledger.ids import Clock, utcnow
from tollgate_llm.ledger.store import EventStore

PURPOSES = frozenset({"batch"})
MAX_FILENAME_CHARS = 255  # batch_files.filename
# Multipart framing around the file, on top of the file's own bound.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
MAX_LIST = 100


@dataclass(frozen=True, slots=True)
class BatchQueue:
    open_batches: int
    pending_items: int
    oldest_age_s: float  # of the oldest open batch that still has items to run (0: none)
    pending_by_model: dict[str, int]  # by the model the items name


class BatchService:
    def __init__(
        self,
        files: BatchStore,
        events: EventStore,
        commands: CommandHandler,
        *,
        windows: Iterable[str] = (),
        clock: Clock = utcnow,
        runner_alive: Callable[[], bool] | None = None,
        retention: Callable[[str, str], str] | None = None,
    ) -> None:
        self.files = files
        self.events = events
        self.commands = commands
        self.windows = tuple(windows)  # extra completion windows this server offers (tests)
        self.clock = clock
        # Whether a batch runner will pick a new batch up (None: one always runs beside this
        # edge, `tollgate serve`'s; the distributed mode's edges read the runner's heartbeat).
        self.runner_alive = runner_alive
        # The retention tier of a (tenant, key)'s batches (the control view's; None: standard).
        self.retention = retention
        # custom_id -> model of each open batch's input file, parsed once (for `queue`).
        self._models: dict[str, dict[str, str]] = {}

    # --- files ----------------------------------------------------------------------------------

    def upload(self, caller: Caller, content_type: str | None, raw: bytes) -> dict[str, Any]:
        """POST /v1/files (multipart: `purpose` and `file`). A batch file is validated whole: a
        bad line is a 400 naming it, and nothing is stored."""
        purpose, filename, content = parse_multipart(content_type, raw)
        if purpose not in PURPOSES:
            raise bad_request("'purpose' must be batch", "purpose")
        try:
            # The file name is stored (a 255-wide column) and shown back: storable, or a 400.
            check_text(filename, "file.filename", max_chars=MAX_FILENAME_CHARS)
        except DomainError as exc:
            raise bad_request(exc.message, exc.field, "invalid_value") from None
        try:
            parse_input(content)
        except DomainError as exc:
            # `line N: <field>` when a line is at fault, else the file.
            raise bad_request(exc.message, exc.field or "file", exc.rule) from None
        now = self.clock()
        stored = StoredFile(
            file_id="file-" + uuid.uuid4().hex[:24], tenant_id=caller.tenant_id,
            purpose=purpose, filename=filename, bytes=len(content), created_at=now,
            # Until a batch uses it; then until that batch ends plus the retention.
            expires_at=now + timedelta(seconds=INPUT_RETENTION_S),
        )
        self.files.put_file(stored, content)
        return file_object(stored)

    def file(self, caller: Caller, file_id: str) -> dict[str, Any]:
        return file_object(self._file(caller, file_id, "file_id"))

    def content(self, caller: Caller, file_id: str) -> bytes:
        _queryable(file_id, "file_id")
        # A zero-retention batch's output is read once: deleted in the read's own transaction.
        found = self.files.content(caller.tenant_id, file_id, self.clock(), consume=True)
        if found is None:
            raise _no_file(file_id, "file_id")
        return bytes(found)

    def delete(self, caller: Caller, file_id: str) -> dict[str, Any]:
        _queryable(file_id, "file_id")
        if not self.files.delete_file(caller.tenant_id, file_id):
            raise _no_file(file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    def _file(self, caller: Caller, file_id: str, param: str) -> StoredFile:
        _queryable(file_id, param)
        found = self.files.file(caller.tenant_id, file_id, self.clock())
        if found is None:  # another tenant's file is not found either: it is not theirs to know
            raise _no_file(file_id, param)
        return found

    # --- batches --------------------------------------------------------------------------------

    def create(self, caller: Caller, raw: bytes) -> dict[str, Any]:
        if self.runner_alive is not None and not self.runner_alive():
            # Accepted, the batch would stay `validating` forever: say so now instead.
            raise ApiError(
                503, "no batch runner is running, so a batch created now would never start; "
                "start one (tollgate batch-runner, beside the edges, with the same "
                "TOLLGATE_BATCH_TOKEN) and retry", type="server_error",
                code="batch_runner_unavailable",
            )  # fmt: skip
        body = _json_object(raw)
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
            raise bad_request(
                f"'endpoint' must be one of {', '.join(sorted(ENDPOINTS))}", "endpoint"
            )
        window = body.get("completion_window")
        window_s = window_seconds(window, self.windows)
        if window_s is None:
            offered = ", ".join(sorted({*WINDOWS_S, *self.windows}))
            raise bad_request(f"'completion_window' must be one of {offered}", "completion_window")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise bad_request("'input_file_id' is required", "input_file_id", "missing_required")
        try:
            metadata = check_metadata(body.get("metadata"))
        except DomainError as exc:
            raise bad_request(exc.message, exc.field or "metadata") from None
        stored = self._file(caller, file_id, "input_file_id")
        if stored.purpose != "batch":
            raise bad_request("the input file's purpose must be batch", "input_file_id")
        content = self.files.content(caller.tenant_id, file_id, self.clock())
        if content is None:
            raise _no_file(file_id, "input_file_id")
        try:
            lines = parse_input(bytes(content))
        except DomainError as exc:
            raise bad_request(exc.message, "input_file_id", exc.rule) from None
        for line in lines:
            if line.url != endpoint:
                raise bad_request(
                    f"line {line.line}: url {line.url} differs from the batch's endpoint",
                    "input_file_id", "mismatched_url",
                )
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        now = self.clock()
        # The input file lives at least as long as the batch may run.
        self.files.set_expiry(
            file_id, max(stored.expires_at, now + timedelta(seconds=window_s + INPUT_RETENTION_S))
        )
        self.files.register(batch_id, caller.tenant_id, now)
        command = CreateBatch(
            batch_id=batch_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
            input_file_id=file_id, endpoint=endpoint, completion_window=str(window),
            window_s=window_s, total=len(lines), now=now,
            metadata_json=json.dumps(metadata, sort_keys=True),
            retention=self.retention(caller.tenant_id, caller.key_id) if self.retention else "",
        )
        self._handle(batch_id, caller.tenant_id, command, now)
        return self.get(caller, batch_id)

    def get(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        _queryable(batch_id, "batch_id")
        # Only the caller's tenant's events, in the one query: another tenant's batch costs
        # what an unknown one does (nothing decoded or folded).
        state = fold(self.events.read_stream(batch_stream(batch_id), caller.tenant_id))
        if state.status == "new" or state.tenant_id != caller.tenant_id:
            raise ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id",
                           code="not_found")
        return batch_object(state)

    def list(self, caller: Caller, after: str | None, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST:
            raise bad_request(f"'limit' must be within 1 and {MAX_LIST}", "limit")
        if after is not None:
            _queryable(after, "after")
        ids = self.files.batch_ids(caller.tenant_id, after, limit + 1)
        streams = self.events.read_streams([batch_stream(i) for i in ids[:limit]])
        data = [batch_object(fold(streams.get(batch_stream(i), []))) for i in ids[:limit]]
        return {
            "object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ids) > limit,
        }

    def cancel(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        self.get(caller, batch_id)  # 404 unless it is this tenant's
        try:
            self._handle(batch_id, caller.tenant_id, CancelBatch(), self.clock())
        except DomainError as exc:
            raise ApiError(409, exc.message, param="batch_id", code="batch_not_cancellable") \
                from None
        return self.get(caller, batch_id)

    def queue(self) -> BatchQueue:
        """The batch queue as /metrics shows it, and the items still to run per requested model
        (the autoscaling signal's deferred demand)."""
        now = self.clock()
        ids = self.files.open_batches()
        streams = self.events.read_streams([batch_stream(i) for i in ids])
        pending, oldest = 0, 0.0
        by_model: dict[str, int] = {}
        for batch_id in ids:
            state = fold(streams.get(batch_stream(batch_id), []))
            left = state.total - state.completed - state.failed
            if left > 0 and not state.ended and state.created_at is not None:
                pending += left
                oldest = max(oldest, (now - state.created_at).total_seconds())
                for custom_id, model in self._item_models(state, now).items():
                    if custom_id not in state.finished:
                        by_model[model] = by_model.get(model, 0) + 1
        for gone in set(self._models) - set(ids):
            del self._models[gone]
        return BatchQueue(len(ids), pending, oldest, by_model)

    def _item_models(self, state: BatchState, now: datetime) -> dict[str, str]:
        models = self._models.get(state.batch_id)
        if models is None:
            content = self.files.content(state.tenant_id, state.input_file_id, now)
            try:
                lines = parse_input(content) if content is not None else []
            except DomainError:
                lines = []  # validated at upload; a file that no longer parses defers nothing
            models = {
                line.custom_id: str(line.body.get("model"))
                for line in lines
                if isinstance(line.body.get("model"), str)
            }
            self._models[state.batch_id] = models
        return models

    def _handle(
        self, batch_id: str, tenant_id: str, command: BatchCommand, now: datetime
    ) -> None:
        self.commands.handle(
            batch_stream(batch_id), lambda state: decide(state, command),
            batch_stream_loader(self.events, batch_id), tenant_id=tenant_id, at=now,
        )


# --- rendering ------------------------------------------------------------------------------------


def file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.file_id, "object": "file", "bytes": f.bytes, "created_at": _epoch(f.created_at),
        "filename": f.filename, "purpose": f.purpose, "status": "processed",
        "expires_at": _epoch(f.expires_at), "status_details": None,
    }


def batch_object(s: BatchState) -> dict[str, Any]:
    errors = None
    if s.error_code:
        errors = {"object": "list",
                  "data": [{"code": s.error_code, "message": s.error_message, "param": None,
                            "line": None}]}
    return {
        "id": s.batch_id, "object": "batch", "endpoint": s.endpoint, "errors": errors,
        "input_file_id": s.input_file_id, "completion_window": s.completion_window,
        "status": s.status, "output_file_id": s.output_file_id, "error_file_id": s.error_file_id,
        "created_at": _epoch(s.created_at), "in_progress_at": _epoch(s.in_progress_at),
        "expires_at": _epoch(s.expires_at), "finalizing_at": _epoch(s.finalizing_at),
        "completed_at": _epoch(s.completed_at), "failed_at": _epoch(s.failed_at),
        "expired_at": _epoch(s.expired_at), "cancelling_at": _epoch(s.cancelling_at),
        "cancelled_at": _epoch(s.cancelled_at),
        "request_counts": {"total": s.total, "completed": s.completed, "failed": s.failed},
        "metadata": json.loads(s.metadata_json) or None,
    }


def _epoch(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def _queryable(value: str, param: str) -> None:
    """An id or cursor compared with stored text: one PostgreSQL cannot take as a parameter (a
    NUL) names nothing and failed there as a 500; it is a 400 naming it on every backend."""
    reason = unstorable(value)
    if reason is not None:
        raise bad_request(f"'{param}' {reason}", param)


def _no_file(file_id: str, param: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id[:100]}", param=param, code="not_found")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def parse_multipart(content_type: str | None, raw: bytes) -> tuple[str, str, bytes]:
    """(purpose, filename, file content) of a multipart/form-data upload, or a 400 naming the
    missing part. The body was bounded before it was read."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("upload the file as multipart/form-data", "file")
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n"
    message = BytesParser(policy=HTTP).parsebytes(head + raw)
    purpose: str | None = None
    found: tuple[str, bytes] | None = None
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        payload = payload if isinstance(payload, bytes) else b""
        if name == "purpose":
            purpose = payload.decode("utf-8", "replace").strip()
        elif name == "file":
            found = (part.get_filename() or "upload.jsonl", payload)
    if purpose is None:
        raise bad_request("'purpose' is required", "purpose", "missing_required")
    if found is None:
        raise bad_request("'file' is required", "file", "missing_required")
    return purpose, found[0], found[1]
