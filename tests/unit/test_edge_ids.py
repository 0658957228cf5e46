"""Event and request ids are formatted by hand on the hot path: they must still be RFC 4122
version-4 UUIDs, and unique."""

from __future__ import annotations

import uuid

from api.edge import new_id, new_request_id


def test_event_ids_are_canonical_version_4_uuids() -> None:
    ids = [new_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    for i in ids[:2_000]:
        parsed = uuid.UUID(i)
        assert str(parsed) == i
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_request_ids_are_req_and_32_hex_digits_of_a_version_4_uuid() -> None:
    rid = new_request_id()
    assert rid.startswith("req_") and len(rid) == 36
    parsed = uuid.UUID(hex=rid[4:])
    assert parsed.hex == rid[4:] and parsed.version == 4
