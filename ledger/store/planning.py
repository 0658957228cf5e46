"""Append planning shared by every EventStore implementation: the stored form of an event,
the structural checks of a batch, and the decision for each batch of an `append_many` (written,
an exact retry answered from the store, or refused) made against the streams' versions and the
events already stored. Storage-specific code only looks things up and writes the rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

import orjson

from tollgate_llm.domain.envelope import Event, Recorded, new_recorded
from tollgate_llm.domain.registry import from_payload, to_payload
from tollgate_llm.ledger.errors import EventIdConflict, StoreError, WrongExpectedVersion
from tollgate_llm.ledger.store.port import AppendBatch, AppendResult, NewEvent

# The events table's columns in the order every SQL path selects and writes them.
COLUMNS = (
    "position",
    "event_id",
    "stream_id",
    "stream_version",
    "tenant_id",
    "occurred_at",
    "type",
    "version",
    "payload",
)


class StoredRow(NamedTuple):
    """An event in its stored form: what idempotent re-appends are compared on."""

    event_id: str
    stream_id: str
    tenant_id: str
    occurred_at: datetime
    type: str
    version: int
    payload: str


_COMPARED = ("stream_id", "tenant_id", "occurred_at", "type", "version")


@dataclass(slots=True)
class Stored:
    """A stored (or about to be stored) event: its row, its stream version and position."""

    row: StoredRow
    stream_version: int
    position: int
    event: Event | None = None  # decoded lazily: a conflict check needs only the row

    def recorded(self) -> Recorded:
        event = self.event
        if event is None:
            event = from_payload(self.row.type, self.row.version, orjson.loads(self.row.payload))
        row = self.row
        return new_recorded(
            row.event_id, row.stream_id, self.stream_version, row.tenant_id, row.occurred_at,
            event, self.position,
        )  # fmt: skip


def encode(new: NewEvent) -> StoredRow:
    if new.occurred_at.tzinfo is None:
        raise ValueError(f"event {new.event_id}: occurred_at must be timezone-aware")
    event = new.event
    payload = orjson.dumps(to_payload(event), option=orjson.OPT_SORT_KEYS).decode()
    return StoredRow(
        new.event_id,
        new.stream_id,
        new.tenant_id,
        new.occurred_at.astimezone(UTC),
        event.EVENT_TYPE,
        event.EVENT_VERSION,
        payload,
    )


def check_batch(batch: AppendBatch) -> None:
    """The structural rules of one append (cheap: nothing is encoded); a malformed batch is a
    bug in the caller and fails loudly."""
    if batch.expected_version is not None and batch.expected_version < 0:
        raise ValueError(f"stream {batch.stream_id!r}: expected_version must be >= 0 or None")
    seen: set[str] = set()
    for new in batch.events:
        if new.stream_id != batch.stream_id:
            raise ValueError(
                f"event {new.event_id} is for stream {new.stream_id!r}, "
                f"appended to {batch.stream_id!r}"
            )
        if new.event_id in seen:
            raise ValueError(f"event {new.event_id} appears twice in one append")
        seen.add(new.event_id)


def prepare_batches(batches: Sequence[AppendBatch]) -> list[list[StoredRow]]:
    """Check and encode every batch before touching storage: a malformed batch fails the whole
    call loudly rather than becoming a per-batch result."""
    for batch in batches:
        check_batch(batch)
    return [[encode(new) for new in batch.events] for batch in batches]


def _differences(stored: StoredRow, new: StoredRow) -> list[str]:
    diffs = [name for name in _COMPARED if getattr(stored, name) != getattr(new, name)]
    if stored.payload != new.payload:
        old, now = orjson.loads(stored.payload), orjson.loads(new.payload)
        keys = sorted(set(old) | set(now))
        diffs += [f"payload.{k}" for k in keys if old.get(k, ...) != now.get(k, ...)]
    return diffs


def _resolve_recorded(
    rows: list[StoredRow], known: Callable[[str], Stored | None]
) -> list[Stored] | StoreError | None:
    """If any event of the batch is already recorded: the stored events when this is an exact
    retry, else the conflict. None when the batch is entirely new."""
    found = [known(row.event_id) for row in rows]
    if all(stored is None for stored in found):
        return None
    if any(stored is None for stored in found):
        first = next(s for s in found if s is not None)
        return EventIdConflict(
            first.row.event_id,
            ["batch"],
            "the append mixes recorded and new events; an append is all-or-nothing, so "
            "a retry must resend exactly the recorded batch",
        )
    stored_rows: list[Stored] = [s for s in found if s is not None]
    for stored, row in zip(stored_rows, rows, strict=True):
        diffs = _differences(stored.row, row)
        if diffs:
            return EventIdConflict(row.event_id, diffs)
    return stored_rows


class Plan:
    """The decision for each batch of an append_many, made under the writer lock: a finished
    result (an error), the stored events it repeats, or new events to write."""

    def __init__(self) -> None:
        self.outcomes: list[AppendResult | tuple[bool, list[Stored]]] = []  # (duplicate, events)
        self.to_write: list[Stored] = []


def plan_appends(
    batches: Sequence[AppendBatch],
    prepared: list[list[StoredRow]],
    versions: dict[str, int],
    lookup: Callable[[list[str]], dict[str, Stored]],
    *,
    check_ids: bool,
) -> Plan:
    """Check every batch in order against `versions` (streams' current versions, updated as
    batches are accepted) and already stored events found by `lookup(event_ids)`.

    With `check_ids` False, ids are looked up only when the version check fails (a retry
    usually arrives with the expected version it first had); a repeated id that passes the
    version check then surfaces as a UNIQUE violation and the caller plans again with True.
    """
    plan = Plan()
    pending: dict[str, Stored] = {}  # accepted earlier in this call, not yet written

    def decide(
        rows: list[StoredRow], stored: dict[str, Stored]
    ) -> list[Stored] | StoreError | None:
        if not stored and pending.keys().isdisjoint([row.event_id for row in rows]):
            return None  # nothing of it is recorded (the usual case): no lookup per event
        return _resolve_recorded(rows, lambda i: pending.get(i) or stored.get(i))

    for batch, rows in zip(batches, prepared, strict=True):
        if not rows:
            plan.outcomes.append(AppendResult(batch.stream_id))
            continue
        ids = [row.event_id for row in rows]
        resolved = decide(rows, lookup(ids) if check_ids else {})
        current = versions.get(batch.stream_id, 0)
        mismatch = batch.expected_version is not None and batch.expected_version != current
        if resolved is None and mismatch and not check_ids:
            resolved = decide(rows, lookup(ids))
        if isinstance(resolved, StoreError):
            plan.outcomes.append(AppendResult(batch.stream_id, error=resolved))
            continue
        if resolved is not None:
            plan.outcomes.append((True, resolved))
            continue
        if mismatch:
            assert batch.expected_version is not None
            error = WrongExpectedVersion(batch.stream_id, batch.expected_version, current)
            plan.outcomes.append(AppendResult(batch.stream_id, error=error))
            continue
        stored = [
            Stored(row, current + offset, 0, new.event)
            for offset, (row, new) in enumerate(zip(rows, batch.events, strict=True), start=1)
        ]
        versions[batch.stream_id] = current + len(rows)
        for s in stored:
            pending[s.row.event_id] = s
        plan.to_write.extend(stored)
        plan.outcomes.append((False, stored))
    return plan


def finish_appends(
    plan: Plan, batches: Sequence[AppendBatch], first_position: int
) -> list[AppendResult]:
    """Number the written events from `first_position` on and give each batch its result."""
    for offset, stored in enumerate(plan.to_write):
        stored.position = first_position + offset
    results: list[AppendResult] = []
    for batch, outcome in zip(batches, plan.outcomes, strict=True):
        if not isinstance(outcome, AppendResult):
            duplicate, stored = outcome
            outcome = AppendResult(batch.stream_id, [s.recorded() for s in stored], None, duplicate)
        results.append(outcome)
    return results


class IdsNeedChecking(Exception):
    """An insert hit a UNIQUE index: a retried event id the fast path did not look up."""

