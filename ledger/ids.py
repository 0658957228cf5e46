"""Ids and instants for new facts: the id source and clock every writer is given (domain makes
neither: they arrive with the command).

Event and request ids need uniqueness, not secrecy: a PRNG seeded from the OS avoids a system
call per id (uuid4 was ~4 % of the edge's CPU). They are UUID version 7 (RFC 9562): 48 bits of
Unix milliseconds, then 74 random bits, so ids made later sort later. The events table's unique
indexes (event_id; stream_id, stream_version) and the read models keyed by request id then grow
at their right edge: with random ids every commit touched a random leaf page of each index, and
on a database of a million events commits slowed enough to matter (measured with
bench/gateway.py after 60k requests).
"""

from __future__ import annotations

import os
import random
import time
from datetime import UTC, datetime
from typing import Protocol


class IdSource(Protocol):
    """Ports: a new id per call, unique (`new_event_id`; tests count or script them)."""

    def __call__(self) -> str: ...


class Clock(Protocol):
    """Ports: the current instant, timezone-aware UTC (`utcnow`; tests hold or advance it)."""

    def __call__(self) -> datetime: ...


_ids = random.Random(int.from_bytes(os.urandom(16), "big"))
_V7_VERSION = 0x7 << 76
_V7_VARIANT = 0x2 << 62


def _v7_hex() -> str:
    ms = time.time_ns() // 1_000_000
    rand = _ids.getrandbits(74)
    value = (ms << 80) | _V7_VERSION | ((rand >> 62) << 64) | _V7_VARIANT | (rand & ((1 << 62) - 1))
    return f"{value:032x}"


def new_event_id() -> str:
    """A canonical UUIDv7 string."""
    h = _v7_hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_writer_tag() -> str:
    """Eight hex digits naming one writing process (random, never reused across restarts)."""
    return f"{_ids.getrandbits(32):08x}"


def tagged_event_ids(tag: str) -> IdSource:
    """Event ids as `new_event_id`'s whose last eight hex digits are `tag`: a follower of the log
    in the same process skips what it wrote by that suffix in the query (`read_tail`), instead
    of reading and decoding every one of its own events to skip them. 42 random bits are left
    beside the millisecond: unique as before for any rate one process writes at."""
    if len(tag) != 8 or tag.strip("0123456789abcdef"):
        raise ValueError("a writer tag is eight lower-case hex digits")

    def new_id() -> str:
        h = _v7_hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:24]}{tag}"

    return new_id


def new_request_id() -> str:
    """`req_` and the 32 hex digits of a UUIDv7: the X-Request-Id and the request's stream id."""
    return "req_" + _v7_hex()


def utcnow() -> datetime:
    return datetime.now(UTC)
