"""Event and request ids are formatted by hand on the hot path: they must still be RFC 9562
version-7 UUIDs (time-ordered, so the indexes keyed by them grow at their right edge), unique,
and later ids must sort after earlier ones."""

from __future__ import annotations

import time
import uuid

from tollgate_llm.ledger.ids import new_event_id as new_id
from tollgate_llm.ledger.ids import new_request_id


def test_event_ids_are_canonical_version_7_uuids_that_sort_by_time() -> None:
    before_ms = time.time_ns() // 1_000_000
    ids = [new_id() for _ in range(20_000)]
    after_ms = time.time_ns() // 1_000_000
    assert len(set(ids)) == len(ids)
    for i in ids[:2_000]:
        parsed = uuid.UUID(i)
        assert str(parsed) == i
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert before_ms <= parsed.int >> 80 <= after_ms
    time.sleep(0.002)
    assert new_id() > max(ids)  # a later millisecond sorts after


def test_request_ids_are_req_and_32_hex_digits_of_a_version_7_uuid() -> None:
    rid = new_request_id()
    assert rid.startswith("req_") and len(rid) == 36
    parsed = uuid.UUID(hex=rid[4:])
    assert parsed.hex == rid[4:] and parsed.version == 7
