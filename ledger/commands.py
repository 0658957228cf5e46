"""The one way a decision becomes facts: load the stream, fold it, decide, append at the version
that was folded; on a version conflict (someone appended meanwhile) load again and decide again,
a bounded number of times, then fail with a clear error.

The expected version is the one the decision saw, never the stream's current one read just before
the append: reading it afresh would let two writers that both decided on an old view both append
(two `TenantRegistered` for one name, with different salts). Every event-sourced decision in
Tollgate goes through here: the control plane, billing, the lease sweeper, and the edge when its
in-memory view of a request turns out to be behind (the sweeper expired it meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from tollgate_llm.domain.batches.evolve import fold as batch_fold
from tollgate_llm.domain.batches.state import BatchState, batch_stream
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.evolve import fold as request_fold
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger.errors import WrongExpectedVersion
from tollgate_llm.ledger.ids import Clock, IdSource, new_event_id, utcnow
from tollgate_llm.ledger.store import AppendBatch, EventStore, NewEvent

__all__ = [
    "CommandHandler",
    "Decision",
    "Handled",
    "StreamLoader",
    "batch_stream_loader",
    "request_stream",
]

S = TypeVar("S")
# A loader answers the state a decision reads and the version of the stream it will append to,
# as of the same read.
StreamLoader = Callable[[], tuple[S, int]]


@dataclass(frozen=True, slots=True)
class Handled:
    """What one command recorded (empty when it changed nothing) and the stream's version after."""

    events: tuple[Event, ...]
    records: list[Recorded] = field(default_factory=list)
    version: int = 0


@dataclass(frozen=True, slots=True)
class Decision(Generic[S]):
    """A decision already taken on folded state, to be appended at `expected_version`. `retry`
    decides again on freshly loaded state if the append loses a race."""

    stream_id: str
    tenant_id: str
    expected_version: int
    events: Sequence[NewEvent]
    retry: Callable[[], Handled] | None = None


class CommandHandler:
    def __init__(
        self,
        store: EventStore,
        *,
        new_id: IdSource = new_event_id,
        clock: Clock = utcnow,
        attempts: int = 5,
    ) -> None:
        self.store = store
        self.new_id = new_id
        self.clock = clock
        self.attempts = attempts

    def handle(
        self,
        stream_id: str,
        decide: Callable[[S], Sequence[Event]],
        load: StreamLoader[S],
        *,
        tenant_id: str,
        at: datetime | None = None,
        event_id: Callable[[int], str] | None = None,
    ) -> Handled:
        """Decide on what `load` answers and append at the version it folded. `at` is the
        instant recorded (default: the clock); `event_id(i)` makes deterministic ids for the
        i-th event (default: fresh ones). DomainErrors from `decide` propagate unchanged."""
        for _ in range(self.attempts):
            state, version = load()
            events = tuple(decide(state))
            if not events:
                return Handled((), [], version)
            when = at or self.clock()
            new = [
                NewEvent(
                    event_id(i) if event_id else self.new_id(), stream_id, tenant_id, when, event
                )
                for i, event in enumerate(events)
            ]
            try:
                records = self.store.append(stream_id, version, new)
            except WrongExpectedVersion:
                continue  # someone appended since the load: decide again on what they wrote
            return Handled(events, records, version + len(records))
        raise DomainError(
            "concurrent_change",
            f"{stream_id} kept changing while this command ran ({self.attempts} attempts); "
            "run it again",
        )

    def append_decided(self, decisions: Sequence[Decision[S]]) -> list[Handled]:
        """Append decisions taken on state folded elsewhere (a consumer's batch) in one group
        commit; each that loses its race is retried through its `retry` (or raises
        WrongExpectedVersion without one). Other store errors are raised."""
        batches = [AppendBatch(d.stream_id, d.expected_version, d.events) for d in decisions]
        handled: list[Handled] = []
        for decision, result in zip(decisions, self.store.append_many(batches), strict=True):
            if isinstance(result.error, WrongExpectedVersion) and decision.retry is not None:
                handled.append(decision.retry())
                continue
            records = result.unwrap()
            events = tuple(r.event for r in records)
            handled.append(Handled(events, records, decision.expected_version + len(records)))
        return handled


def request_stream(store: EventStore, request_id: str) -> StreamLoader[RequestState]:
    """A request's state and stream version, folded from the store."""

    def load() -> tuple[RequestState, int]:
        state = request_fold(store.read_stream(request_id))
        return state, state.version

    return load


def batch_stream_loader(store: EventStore, batch_id: str) -> StreamLoader[BatchState]:
    """A batch's state and stream version, folded from the store."""

    def load() -> tuple[BatchState, int]:
        state = batch_fold(store.read_stream(batch_stream(batch_id)))
        return state, state.version

    return load
