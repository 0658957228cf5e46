"""The record format on the topic: one JSON object per stored event, keyed by tenant id.

The envelope carries the store's order key (`txid`, `position`) beside the event, so a consumer
can tell a re-published record from a new one, and the payload exactly as stored (the relay
forwards the stored JSON text; a consumer decodes it through `domain`'s upcasters, as the store
does). A record that is not such an object, or names an event type or version this code does not
know, is refused with the reason (`BadRecord`): the consumer dead-letters it and goes on.
"""

from __future__ import annotations

import operator
from typing import Any, Final

import orjson

from tollgate_llm.domain.envelope import Recorded, new_recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.registry import from_payload, parse_instant
from tollgate_llm.ledger.outbox import OutboxRow

EPOCH_HEADER = "tollgate-epoch"
REASON_HEADER = "tollgate-dead-letter-reason"
# Bounds what a consumer accepts (the store's own bounds are smaller: payloads are events).
MAX_RECORD_BYTES = 1_048_576


class BadRecord(Exception):
    """A record no fold can apply; `reason` says why (it goes with the dead letter)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(row: OutboxRow) -> tuple[bytes, bytes]:
    """(key, value) of the message for one stored event."""
    value = orjson.dumps(
        {
            "event_id": row.event_id,
            "stream_id": row.stream_id,
            "stream_version": row.stream_version,
            "tenant_id": row.tenant_id,
            "occurred_at": row.occurred_at.isoformat(),
            "type": row.type,
            "version": row.version,
            "position": row.position,
            "txid": row.txid,
            "payload": orjson.Fragment(row.payload),
        }
    )
    return row.tenant_id.encode(), value


# The envelope's fields and their JSON types, in Recorded's order then txid.
_ENVELOPE: Final = (
    ("event_id", str), ("stream_id", str), ("stream_version", int), ("tenant_id", str),
    ("occurred_at", str), ("type", str), ("version", int), ("position", int), ("txid", int),
)  # fmt: skip
_FIELDS: Final = operator.itemgetter(*(name for name, _ in _ENVELOPE))
_KINDS: Final = tuple(kind for _, kind in _ENVELOPE)


def decode(value: bytes | None) -> tuple[Recorded, int]:
    """The event a message carries and its transaction id; BadRecord if it cannot be one."""
    if value is None:
        raise BadRecord("empty record")
    if len(value) > MAX_RECORD_BYTES:
        raise BadRecord(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        data: Any = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadRecord(f"not JSON: {exc}") from None
    if type(data) is not dict:
        raise BadRecord("not a JSON object")
    try:
        payload = data["payload"]
        fields = _FIELDS(data)
    except KeyError as exc:
        raise BadRecord(f"missing field {exc.args[0]}") from None
    if type(payload) is not dict:
        raise BadRecord("payload: not an object")
    # One comparison for the whole envelope (a worker decodes thousands a second); the field
    # at fault is looked for only when it fails.
    if tuple(map(type, fields)) != _KINDS:
        for (name, kind), field in zip(_ENVELOPE, fields, strict=True):
            if type(field) is not kind:
                raise BadRecord(f"{name}: expected {kind.__name__}")
    event_id, stream_id, stream_version, tenant_id, occurred_at, type_, version, position, txid = (
        fields
    )
    try:
        event = from_payload(type_, version, payload)
        instant = parse_instant(occurred_at)
    except DomainError as exc:
        raise BadRecord(f"{exc.rule}: {exc.message}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise BadRecord(f"{type_} v{version}: {exc}") from None
    recorded = new_recorded(
        event_id, stream_id, stream_version, tenant_id, instant, event, position
    )
    return recorded, txid
