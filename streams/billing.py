"""The billing fold: every terminal event becomes exactly one UsageBilled, priced at admission
(`domain.billing.bill_terminal` decides it; this module feeds it and records what it decides).

At-least-once in, exactly-once in effect: the bill's event id is derived from the request id and
its terminal event's instant, so a redelivered terminal event (or a crash between the append and
the checkpoint) re-appends the same event, which the store answers as already there. The
request stream's expected version refuses a second, different one.

It bills in batches: the request states come from the same records it is handed (a request's
events are in the log before its terminal event), so a bill costs no read; all the bills of a
pass are one group commit, and a bill that loses a race (something appended after the terminal
event) is decided again on the stored stream through the command handler.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import sqlalchemy as sa

from tollgate_llm.domain.billing import Bill, bill_terminal
from tollgate_llm.domain.control_plane.adapters import price_key_of
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.events import TERMINAL_TYPES, RequestAdmitted, UsageBilled
from tollgate_llm.domain.requests.evolve import evolve, fold
from tollgate_llm.domain.requests.state import INITIAL, RequestState
from tollgate_llm.ledger import dead_letters, faults
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.commands import CommandHandler, Decision, Handled, request_stream
from tollgate_llm.ledger.engine import WRITE
from tollgate_llm.ledger.store import EventStore, NewEvent

log = logging.getLogger("tollgate.billing")

__all__ = ["BillingFold"]


class BillingFold:
    name = "billing"

    def __init__(
        self,
        store: EventStore,
        checkpoints: Checkpoints,
        control: ControlView,
        commands: CommandHandler | None = None,
        *,
        engine: sa.Engine | None = None,
    ) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.control = control
        self.commands = commands or CommandHandler(store)
        self.position = checkpoints.get(self.name)
        # Requests seen admitted and not yet billed, folded from the records handed in.
        self.states: dict[str, RequestState] = {}
        # Requests the fold could not bill, with the rule that refused (e.g. no price in force).
        # They are not retried silently: /readyz and /metrics show them, and the reconciliation
        # report lists each as a terminal event without a bill. With an `engine` each is also
        # kept in the `dead_letters` table (fold "billing"), which outlives this process and
        # `tollgate dead-letters replay` bills again once fixed (a price set, say).
        self.dead_letters: dict[str, str] = {}
        self._engine = engine
        self._unbillable: list[dead_letters.DeadLetter] = []
        # Requests with an unreplayed billing dead letter (read once, at the first batch): one
        # billed since (the fold run again after a price was set) resolves its dead letter.
        self._dead_streams: set[str] | None = None

    def run_to_end(self, batch: int = 2000) -> int:
        """Catch up by reading the log itself (at start-up, or without a fold pass)."""
        total = 0
        while records := self.store.read_all(self.position, batch):
            self.process(records)
            total += len(records)
        return total

    def lag(self) -> int:
        return max(0, self.store.last_position() - self.position)

    def process(
        self, records: list[Recorded], *, save_checkpoint: bool = True
    ) -> list[Recorded]:
        """Fold `records` (in position order; those at or before the checkpoint are skipped),
        bill every request they end, commit the bills together, then move the checkpoint.
        Returns the bills as stored (`bill_recorded`).

        With `save_checkpoint` False only `position` moves; the caller saves it (the fold
        worker, in its read-model transaction: one write transaction fewer per pass). A saved
        checkpoint behind the bills is harmless: the bills it repeats are already there."""
        fresh = [r for r in records if r.position > self.position]
        if not fresh:
            return []
        stored = self.bill_recorded(fresh)[1]
        self.position = fresh[-1].position
        if save_checkpoint:
            self.checkpoints.set(self.name, self.position)
        return stored

    def bill(self, fresh: list[Recorded]) -> int:
        """Fold `fresh` (each request's events in its order; position order across requests
        is not needed: a Kafka worker hands in several partitions) and commit a bill for every
        request they end; returns how many bills were decided. No checkpoint moves here."""
        return self.bill_recorded(fresh)[0]

    def bill_recorded(self, fresh: list[Recorded]) -> tuple[int, list[Recorded]]:
        """`bill`, also answering the bills as stored (with their positions): those just
        appended and those the store already held (a redelivered terminal event), so a caller
        can write their ledger rows without waiting for the bills to come back through a log."""
        # The whole batch is folded before anything is decided: a terminal event is appended
        # with its refund after it, so a bill decided at the terminal record would be one event
        # behind its stream, lose the version race and cost a read of the stream to decide again.
        ended: dict[str, Recorded] = {}
        for record in fresh:
            self._track(record)
            if record.type in TERMINAL_TYPES:
                ended[record.stream_id] = record
        decisions: list[Decision[RequestState]] = []
        for rid, terminal in ended.items():
            decision = self._decide(rid, self.states.pop(rid, None), terminal)
            if decision is not None:
                decisions.append(decision)
        stored: list[Recorded] = []
        if decisions:
            for handled in self.commands.append_decided(decisions):
                stored.extend(r for r in handled.records if type(r.event) is UsageBilled)
            faults.point("billing.after_append", position=fresh[-1].position)
        self._keep_unbillable()
        self._resolve(stored)
        return len(decisions), stored

    def _resolve(self, stored: list[Recorded]) -> None:
        """Bills of requests that had a dead letter here: it is resolved (marked replayed)."""
        if self._engine is None:
            return
        if self._dead_streams is None:
            with self._engine.connect() as conn:
                self._dead_streams = dead_letters.unreplayed_streams(conn, self.name)
        resolved = {b.stream_id for b in stored} & self._dead_streams
        if not resolved:
            return
        with self._engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                dead_letters.resolve_streams(conn, self.name, resolved, datetime.now(UTC))
        self._dead_streams -= resolved

    def _keep_unbillable(self) -> None:
        """The requests this batch could not bill, into the dead-letter table before the batch
        counts as done (a failure here fails the batch, which is billed again: the bills are
        answered as already there, the dead letters recorded once)."""
        if not self._unbillable or self._engine is None:
            self._unbillable.clear()
            return
        with self._engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                dead_letters.record(conn, self._unbillable, datetime.now(UTC))
        if self._dead_streams is not None:
            self._dead_streams.update(d.stream_id for d in self._unbillable)
        self._unbillable.clear()

    def replay(self, record: Recorded) -> None:
        """Bill the request a dead-lettered `record` belongs to, from its stored stream (after
        the fix: a price set, a bug fixed); nothing if it has not ended or is billed already.
        Raises what still refuses it. The bill's id and expected version are the ones the fold
        would have used, so a replay and a late pass never bill twice."""
        state = fold(self.store.read_stream(record.stream_id))
        if state.finished_at is None or state.billed:
            return
        price = self.control.price(
            state.model, state.admitted_at, state.service_tier,  # type: ignore[arg-type]
            price_key_of(state.tenant_id, state.adapter),
        )
        bill = bill_terminal(state, price)
        if bill is None:
            return
        new = NewEvent(bill.event_id, bill.request_id, bill.tenant_id, bill.occurred_at, bill.event)
        self.commands.append_decided(
            [Decision(bill.request_id, bill.tenant_id, bill.expected_version, (new,),
                      lambda: self._bill_stored(bill))]
        )  # fmt: skip
        self.dead_letters.pop(record.stream_id, None)

    def _track(self, record: Recorded) -> None:
        rid = record.stream_id
        try:
            if isinstance(record.event, RequestAdmitted):
                self.states[rid] = evolve(INITIAL, record)
            elif rid in self.states:
                self.states[rid] = evolve(self.states[rid], record)
        except DomainError as exc:
            # Billing then refolds the stored stream, where the same rule fails loudly.
            log.error("request %s: %s", rid, exc.message)
            self.states.pop(rid, None)

    def _decide(
        self, rid: str, state: RequestState | None, terminal: Recorded | None = None
    ) -> Decision[RequestState] | None:
        if state is None or state.version == 0:
            # Admitted before this fold's checkpoint (a restart): read the whole stream.
            state = fold(self.store.read_stream(rid))
        bill = self._bill(state, terminal)
        if bill is None:
            return None
        new = NewEvent(bill.event_id, rid, bill.tenant_id, bill.occurred_at, bill.event)
        return Decision(
            rid, bill.tenant_id, bill.expected_version, (new,), lambda: self._bill_stored(bill)
        )

    def _bill(
        self, state: RequestState, terminal: Recorded | None = None
    ) -> Bill | None:
        try:
            price = self.control.price(
                state.model, state.admitted_at, state.service_tier,  # type: ignore[arg-type]
                price_key_of(state.tenant_id, state.adapter),
            )
            return bill_terminal(state, price)
        except DomainError as exc:
            reason = f"{exc.rule}: {exc.message}"
            self.dead_letters[state.request_id] = reason
            if terminal is not None:
                self._unbillable.append(dead_letters.DeadLetter.of(self.name, terminal, reason))
            log.error("cannot bill %s: %s", state.request_id, exc.message)
            return None

    def _bill_stored(self, first: Bill) -> Handled:
        """Bill again on the stored stream (the first decision lost a race)."""

        def decide(state: RequestState) -> tuple[Event, ...]:
            bill = self._bill(state)
            return () if bill is None else (bill.event,)

        return self.commands.handle(
            first.request_id,
            decide,
            request_stream(self.store, first.request_id),
            tenant_id=first.tenant_id,
            at=first.occurred_at,
            event_id=lambda _: first.event_id,
        )
