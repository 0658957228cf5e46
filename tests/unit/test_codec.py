"""The record on the topic: a stored event's envelope goes out and comes back as the same
`Recorded`; a record that cannot be one is refused with the field at fault named."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from tests import builders as b
from tollgate_llm.domain.registry import to_payload
from tollgate_llm.ledger.outbox import OutboxRow
from tollgate_llm.streams.codec import BadRecord, decode, encode


def _row(**kw: object) -> OutboxRow:
    event = b.admitted()
    fields = {
        "txid": 812, "position": 42, "event_id": "evt-1", "stream_id": b.RID,
        "stream_version": 1, "tenant_id": b.TENANT,
        "occurred_at": datetime(2026, 12, 6, 20, 0, tzinfo=UTC),
        "type": type(event).EVENT_TYPE, "version": type(event).EVENT_VERSION,
        "payload": orjson.dumps(to_payload(event)).decode(),
    }  # fmt: skip
    return OutboxRow(**{**fields, **kw})  # type: ignore[arg-type]


def _value(**changes: object) -> bytes:
    data = orjson.loads(encode(_row())[1])
    for name, value in changes.items():
        if value is KeyError:
            del data[name]
        else:
            data[name] = value
    return orjson.dumps(data)


def test_an_encoded_event_decodes_to_the_recorded_event_and_its_txid() -> None:
    key, value = encode(_row())
    recorded, txid = decode(value)
    assert key == b.TENANT.encode() and txid == 812
    assert (recorded.event_id, recorded.stream_id, recorded.stream_version) == ("evt-1", b.RID, 1)
    assert recorded.position == 42 and recorded.tenant_id == b.TENANT
    assert recorded.occurred_at == datetime(2026, 12, 6, 20, 0, tzinfo=UTC)
    assert recorded.event == b.admitted()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"stream_version": "1"}, "stream_version: expected int"),
        ({"txid": True}, "txid: expected int"),
        ({"tenant_id": 7}, "tenant_id: expected str"),
        ({"position": KeyError}, "missing field position"),
        ({"payload": KeyError}, "missing field payload"),
        ({"payload": [1]}, "payload: not an object"),
        ({"occurred_at": "2026-12-06T20:00:00"}, "naive_datetime"),
        ({"type": "NoSuchEvent"}, "unknown_event_type"),
    ],
)
def test_a_record_that_cannot_be_an_event_is_refused_naming_why(
    changes: dict[str, object], reason: str
) -> None:
    with pytest.raises(BadRecord) as refused:
        decode(_value(**changes))
    assert reason in refused.value.reason


def test_what_is_not_a_json_object_is_refused() -> None:
    refused_values = [(None, "empty record"), (b"{", "not JSON"), (b"[1]", "not a JSON object")]
    for value, reason in refused_values:
        with pytest.raises(BadRecord) as refused:
            decode(value)
        assert refused.value.reason.startswith(reason)
