"""The billing fold: every terminal event becomes exactly one UsageBilled, priced at admission.

At-least-once in, exactly-once in effect: the UsageBilled event id is derived from the request id,
so a redelivered terminal event (or a crash between the append and the checkpoint) re-appends the
same event, which the store answers as already there. The request stream's fold also refuses a
second bill.
"""

from __future__ import annotations

import logging
import uuid

from domain import lifecycle
from domain.control import ControlView
from domain.errors import DomainError
from domain.events import TERMINAL_EVENTS, Recorded
from ledger.checkpoints import Checkpoints
from ledger.store import EventStore, NewEvent, WrongExpectedVersion

log = logging.getLogger("tollgate.billing")

BILLING_NAMESPACE = uuid.UUID("6f1d2b1e-5c8a-4e0b-9a57-0c3f3f7f2a11")
TERMINAL_TYPES = frozenset(cls.EVENT_TYPE for cls in TERMINAL_EVENTS)


def billed_event_id(request_id: str) -> str:
    return str(uuid.uuid5(BILLING_NAMESPACE, f"{request_id}/UsageBilled"))


class BillingFold:
    name = "billing"

    def __init__(self, store: EventStore, checkpoints: Checkpoints, control: ControlView) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.control = control
        # Requests the fold could not bill, with the rule that refused (e.g. no price in force).
        # They are not retried silently: /readyz and /metrics show them, and the reconciliation
        # report lists each as a terminal event without a bill.
        self.dead_letters: dict[str, str] = {}

    def run_once(self, batch: int = 1000) -> int:
        position = self.checkpoints.get(self.name)
        records = self.store.read_all(position, batch)
        for record in records:
            if record.type in TERMINAL_TYPES:
                try:
                    self.bill(record)
                except DomainError as exc:
                    self.dead_letters[record.stream_id] = f"{exc.rule}: {exc.message}"
                    log.error("cannot bill %s: %s", record.stream_id, exc.message)
        if records:
            self.checkpoints.set(self.name, records[-1].position)
        return len(records)

    def run_to_end(self) -> int:
        total = 0
        while n := self.run_once():
            total += n
        return total

    def lag(self) -> int:
        return max(0, self.store.last_position() - self.checkpoints.get(self.name))

    def bill(self, terminal: Recorded) -> None:
        for _ in range(3):
            stream = self.store.read_stream(terminal.stream_id)
            state = lifecycle.fold(stream)
            if state.billed:
                return
            price = self.control.price(state.model, state.admitted_at)
            events = lifecycle.decide(state, lifecycle.BillUsage(request_id=terminal.stream_id, price=price))
            new = [
                NewEvent(
                    event_id=billed_event_id(terminal.stream_id),
                    stream_id=terminal.stream_id,
                    tenant_id=terminal.tenant_id,
                    occurred_at=terminal.occurred_at,
                    event=event,
                )
                for event in events
            ]
            try:
                self.store.append(terminal.stream_id, state.version, new)
                return
            except WrongExpectedVersion:
                continue  # something was appended meanwhile: refold and decide again
        raise RuntimeError(f"could not bill {terminal.stream_id}: the stream kept changing")
