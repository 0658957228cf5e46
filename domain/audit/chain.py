"""The hash chain of a control stream, pure: `seal` for the record that closes a command,
`verify` for a stream as stored.

A stream's chain starts at GENESIS and takes every event in version order: an event moves it
to sha256(chain, its canonical form); an audit record's `seal` is that hash over the record
itself (its payload without the seal), and the chain continues from the seal it recorded. So
each seal vouches for every byte of every event before it in its stream — envelope and payload
as stored — and for itself. An edited event breaks the next seal (or its own); a deleted one
leaves a gap in the stream's versions and breaks the next seal; a deleted last audit record
leaves the events it sealed unsealed. What a chain cannot show alone is a stream cut back to an
earlier seal, the whole last command gone: `verify` reports each stream's head (its last sealed
version and seal) so that a copy kept elsewhere can pin it.

The hash is unkeyed: it finds an edit made without recomputing the chain from there on, which
is the accident and the careless edit; a writer who recomputes it is caught only by a head
kept elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeGuard

from tollgate_llm.domain.audit.events import ChangeAudited

GENESIS: Final = "0" * 64
_SEAL: Final = re.compile("[0-9a-f]{64}")
AUDIT_TYPE: Final = ChangeAudited.EVENT_TYPE
# The control streams an operator changes (domain.control_plane.state's names); an agent run's
# stream (`run-`) is its customer's, not the control plane's, and is not audited.
AUDITED_PREFIXES: Final = ("tenant-", "prices-", "slo-", "fleet", "models-")


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One event as stored: its envelope and its payload (the stored JSON, parsed)."""

    stream_id: str
    stream_version: int
    event_id: str
    tenant_id: str
    occurred_at: datetime
    type: str
    version: int
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StreamCheck:
    """What `verify` found in one stream: `head` is the seal of its last audit record (GENESIS:
    none) and `sealed_through` that record's version."""

    stream_id: str
    events: int
    sealed_through: int
    head: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def canonical(row: AuditRow, *, without_seal: bool = False) -> bytes:
    """The bytes a row is hashed as: its envelope and payload as sorted, compact JSON (so the
    same stored event hashes the same from either store, whatever order the keys were written
    in)."""
    payload = dict(row.payload)
    if without_seal:
        payload.pop("seal", None)
    at = row.occurred_at.astimezone(UTC).isoformat(timespec="microseconds")
    form = [row.stream_id, row.stream_version, row.event_id, row.tenant_id, at, row.type,
            row.version, payload]  # fmt: skip
    return json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def link(chain: str, row: AuditRow, *, without_seal: bool = False) -> str:
    return hashlib.sha256(
        chain.encode() + b"\n" + canonical(row, without_seal=without_seal)
    ).hexdigest()


def head(rows: Sequence[AuditRow]) -> str:
    """The chain after `rows` (a stream's first events, in version order)."""
    chain = GENESIS
    for row in rows:
        if row.type != AUDIT_TYPE:
            chain = link(chain, row)
        elif _is_seal(recorded := row.payload.get("seal")):
            chain = recorded
        else:  # as `verify` goes on past a record whose seal is not one
            chain = link(chain, row, without_seal=True)
    return chain


def seal(before: Sequence[AuditRow], record: AuditRow) -> str:
    """The seal of an audit record appended after `before` (the stream's events up to it, the
    facts of its own command included)."""
    return link(head(before), record, without_seal=True)


def verify(stream_id: str, rows: Sequence[AuditRow]) -> StreamCheck:
    """Check one stream's chain (its events in version order), naming every problem."""
    problems: list[str] = []
    chain = last_seal = GENESIS
    expected = 1
    sealed_through = 0
    for row in rows:
        if row.stream_version != expected:
            missing = (f"version {expected}" if row.stream_version == expected + 1
                       else f"versions {expected}-{row.stream_version - 1}")  # fmt: skip
            problems.append(f"{missing} missing: an event was deleted")
        expected = row.stream_version + 1
        if row.type != AUDIT_TYPE:
            chain = link(chain, row)
            continue
        recorded = row.payload.get("seal")
        computed = link(chain, row, without_seal=True)
        if recorded != computed:
            problems.append(
                f"version {row.stream_version}: the audit record's seal does not match: an event "
                f"in versions {sealed_through + 1}-{row.stream_version} was edited or deleted"
            )
        # Go on from the seal as recorded, so each later record is judged on its own events.
        chain = last_seal = recorded if _is_seal(recorded) else computed
        sealed_through = row.stream_version
    if rows and rows[-1].stream_version > sealed_through:
        problems.append(
            f"versions {sealed_through + 1}-{rows[-1].stream_version} are sealed by no audit "
            "record (written around the trail, before it began, or its record was deleted)"
        )
    return StreamCheck(stream_id, len(rows), sealed_through, last_seal, tuple(problems))


def _is_seal(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and _SEAL.fullmatch(value) is not None
