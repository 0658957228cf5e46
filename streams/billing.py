"""The billing fold: every terminal event becomes exactly one UsageBilled, priced at admission.

At-least-once in, exactly-once in effect: the UsageBilled event id is derived from the request id
and its terminal event's instant, so a redelivered terminal event (or a crash between the append
and the checkpoint) re-appends the same event, which the store answers as already there. The
request stream's fold also refuses a second bill.

It bills in batches: the request states come from the same records it is handed (a request's
events are in the log before its terminal event), so a bill costs no read; all the bills of a
pass are one group commit.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from datetime import UTC, datetime, timedelta

from domain import lifecycle
from domain.control import ControlView
from domain.errors import DomainError
from domain.events import TERMINAL_EVENTS, Recorded, RequestAdmitted
from ledger.checkpoints import Checkpoints
from ledger.store import AppendBatch, EventStore, NewEvent, WrongExpectedVersion

log = logging.getLogger("tollgate.billing")

BILLING_NAMESPACE = uuid.UUID("6f1d2b1e-5c8a-4e0b-9a57-0c3f3f7f2a11")
TERMINAL_TYPES = frozenset(cls.EVENT_TYPE for cls in TERMINAL_EVENTS)


_NAMESPACE_BYTES = BILLING_NAMESPACE.bytes
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_MS_MASK = (1 << 48) - 1
_V8 = 0x8 << 76 | 0x2 << 62  # version 8, RFC 9562 variant
# What the hash fills: the 12 bits after the version and the 62 after the variant.
_RANDOM_BITS = (0xFFF << 64) | ((1 << 62) - 1)


def billed_event_id(request_id: str, ended_at: datetime) -> str:
    """The bill's event id, derived from the request id and its terminal event's instant (both
    immutable), so a redelivered terminal re-appends the same event.

    A UUID version 8 (RFC 9562) laid out like the edge's version-7 ids: 48 bits of the
    terminal's Unix milliseconds, then 74 bits of the request's uuid5. Bills made later then
    sort later and land at the right edge of the events table's UNIQUE (event_id) index, as
    every other event does; a plain uuid5 put each bill in a random leaf page of that index
    (a page read, a page written to the WAL and checkpointed back, per bill)."""
    # uuid5's hash (SHA-1 of namespace + name), without building the UUID object: the bits
    # kept are the same (uuid5 only overwrites the version and variant bits, replaced here too).
    name = _NAMESPACE_BYTES + f"{request_id}/UsageBilled".encode()
    digest = int.from_bytes(hashlib.sha1(name, usedforsecurity=False).digest()[:16], "big")
    ms = (ended_at - _EPOCH) // _MS
    value = (ms & _MS_MASK) << 80 | _V8 | (digest & _RANDOM_BITS)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class BillingFold:
    name = "billing"

    def __init__(self, store: EventStore, checkpoints: Checkpoints, control: ControlView) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.control = control
        self.position = checkpoints.get(self.name)
        # Requests seen admitted and not yet billed, folded from the records handed in.
        self.states: dict[str, lifecycle.RequestState] = {}
        # Requests the fold could not bill, with the rule that refused (e.g. no price in force).
        # They are not retried silently: /readyz and /metrics show them, and the reconciliation
        # report lists each as a terminal event without a bill.
        self.dead_letters: dict[str, str] = {}

    def run_to_end(self, batch: int = 2000) -> int:
        """Catch up by reading the log itself (at start-up, or without a fold pass)."""
        total = 0
        while records := self.store.read_all(self.position, batch):
            self.process(records)
            total += len(records)
        return total

    def lag(self) -> int:
        return max(0, self.store.last_position() - self.position)

    def process(self, records: list[Recorded], *, save_checkpoint: bool = True) -> None:
        """Fold `records` (in position order; those at or before the checkpoint are skipped),
        bill every request they end, commit the bills together, then move the checkpoint.

        With `save_checkpoint` False only `position` moves; the caller saves it (the fold
        worker, in its read-model transaction: one write transaction fewer per pass). A saved
        checkpoint behind the bills is harmless: the bills it repeats are already there."""
        fresh = [r for r in records if r.position > self.position]
        if not fresh:
            return
        ended: list[Recorded] = []
        for record in fresh:
            self._track(record)
            if record.type in TERMINAL_TYPES:
                ended.append(record)
        batches: list[AppendBatch] = []
        for terminal in ended:
            batch = self._bill_batch(terminal, self.states.pop(terminal.stream_id, None))
            if batch is not None:
                batches.append(batch)
        if batches:
            for batch, result in zip(batches, self.store.append_many(batches), strict=True):
                if isinstance(result.error, WrongExpectedVersion):
                    # Something was appended after the terminal event: refold from the store.
                    self._bill_from_store(batch.events[0].stream_id)
                elif result.error is not None:
                    raise result.error
        self.position = fresh[-1].position
        if save_checkpoint:
            self.checkpoints.set(self.name, self.position)

    def _track(self, record: Recorded) -> None:
        rid = record.stream_id
        try:
            if isinstance(record.event, RequestAdmitted):
                self.states[rid] = lifecycle.evolve(lifecycle.INITIAL, record)
            elif rid in self.states:
                self.states[rid] = lifecycle.evolve(self.states[rid], record)
        except DomainError as exc:
            # Billing then refolds the stored stream, where the same rule fails loudly.
            log.error("request %s: %s", rid, exc.message)
            self.states.pop(rid, None)

    def _bill_batch(
        self, terminal: Recorded, state: lifecycle.RequestState | None
    ) -> AppendBatch | None:
        rid = terminal.stream_id
        if state is None or state.version == 0:
            # Admitted before this fold's checkpoint (a restart): read the whole stream.
            state = lifecycle.fold(self.store.read_stream(rid))
        if state.billed:
            return None
        try:
            price = self.control.price(state.model, state.admitted_at)  # type: ignore[arg-type]
            events = lifecycle.decide(state, lifecycle.BillUsage(request_id=rid, price=price))
        except DomainError as exc:
            self.dead_letters[rid] = f"{exc.rule}: {exc.message}"
            log.error("cannot bill %s: %s", rid, exc.message)
            return None
        new = tuple(
            # Deterministic id and instant: a redelivered terminal re-appends the same event.
            NewEvent(
                billed_event_id(rid, terminal.occurred_at), rid, terminal.tenant_id,
                terminal.occurred_at, e,
            )
            for e in events
        )
        return AppendBatch(rid, state.version, new)

    def _bill_from_store(self, request_id: str) -> None:
        for _ in range(3):
            stream = self.store.read_stream(request_id)
            terminal = next(r for r in stream if r.type in TERMINAL_TYPES)
            batch = self._bill_batch(terminal, lifecycle.fold(stream))
            if batch is None:
                return
            try:
                self.store.append(request_id, batch.expected_version, batch.events)
                return
            except WrongExpectedVersion:
                continue
        raise RuntimeError(f"could not bill {request_id}: its stream kept changing")
