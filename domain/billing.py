"""Billing one request (DESIGN §4, invariants 3 and 4): its terminal event becomes exactly one
`UsageBilled`, from the engine's counts, at the price in force at admission.

`bill_terminal` is pure: the same request state and terminal event always give the same bill,
with the same event id. That is what makes the billing fold exactly-once in effect under
at-least-once delivery: a redelivered terminal (or a crash between a bill's append and the
consumer's checkpoint) re-appends the identical event, which the store answers as already there,
and the request stream's expected version refuses a second, different one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from tollgate_llm.domain.cost import Price
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import BillUsage, decide
from tollgate_llm.domain.requests.events import UsageBilled
from tollgate_llm.domain.requests.state import RequestState

__all__ = ["Bill", "bill_event_id", "bill_terminal"]

# The uuid5 namespace of bill ids (6f1d2b1e-5c8a-4e0b-9a57-0c3f3f7f2a11), as its 16 bytes: the
# uuid module is kept out of domain, whose ids otherwise arrive with the command.
BILLING_NAMESPACE_BYTES: Final = bytes.fromhex("6f1d2b1e5c8a4e0b9a570c3f3f7f2a11")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MS: Final = timedelta(milliseconds=1)
_MS_MASK: Final = (1 << 48) - 1
_V8: Final = 0x8 << 76 | 0x2 << 62  # version 8, RFC 9562 variant
# What the hash fills: the 12 bits after the version and the 62 after the variant.
_RANDOM_BITS: Final = (0xFFF << 64) | ((1 << 62) - 1)


@dataclass(frozen=True, slots=True)
class Bill:
    """A ledger entry ready to append to its request's stream at `expected_version`."""

    request_id: str
    tenant_id: str
    expected_version: int
    event_id: str
    occurred_at: datetime  # the terminal event's instant: usage is bucketed by it
    event: UsageBilled

    def __post_init__(self) -> None:
        if self.expected_version < 1:
            raise DomainError("not_admitted", "a bill follows a request's own events")


def bill_event_id(request_id: str, ended_at: datetime) -> str:
    """The bill's event id, derived from the request id and its terminal event's instant (both
    immutable), so a redelivered terminal re-appends the same event.

    A UUID version 8 (RFC 9562) laid out like the edge's version-7 ids: 48 bits of the
    terminal's Unix milliseconds, then 74 bits of the request's uuid5. Bills made later then
    sort later and land at the right edge of the events table's UNIQUE (event_id) index, as
    every other event does; a plain uuid5 put each bill in a random leaf page of that index
    (a page read, a page written to the WAL and checkpointed back, per bill)."""
    # uuid5's hash (SHA-1 of namespace + name), without building the UUID object: the bits
    # kept are the same (uuid5 only overwrites the version and variant bits, replaced here too).
    name = BILLING_NAMESPACE_BYTES + f"{request_id}/UsageBilled".encode()
    digest = int.from_bytes(hashlib.sha1(name, usedforsecurity=False).digest()[:16], "big")
    ms = (ended_at - _EPOCH) // _MS
    value = (ms & _MS_MASK) << 80 | _V8 | (digest & _RANDOM_BITS)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def bill_terminal(state: RequestState, price: Price) -> Bill | None:
    """The bill of a request whose stream, folded into `state`, has ended; None when it is
    already billed. `price` is the price in force at `state.admitted_at`. The bill is recorded at
    the terminal event's instant, with an id derived from it. A request that cannot be billed
    (not admitted, not ended, a price for another model) is a DomainError naming the rule."""
    if state.billed:
        return None
    (event,) = decide(state, BillUsage(price=price, request_id=state.request_id))
    assert isinstance(event, UsageBilled) and state.finished_at is not None
    return Bill(
        state.request_id,
        state.tenant_id,
        state.version,
        bill_event_id(state.request_id, state.finished_at),
        state.finished_at,
        event,
    )
