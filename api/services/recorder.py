"""The edge's side of the event log: each admitted request's stream, held in memory while it is
in flight, its commands decided by `domain.requests` and appended at the version they were
decided on; refusals and lease renewals recorded the same way.

The edge is the main writer of a request's stream while it serves it, so it decides on its own
folded state and never reads the store on the request path. The other writers are the lease
sweeper, after the edge went silent for the lease TTL, and another edge asking for a flex
request's preemption (PreemptionRequested). Either way the edge's next append loses on the
expected version, and the command handler decides again on the stored stream — where the
request may have already ended, which is said and counted, never silently dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import EventSink, Replica
from tollgate_llm.api.services.stored_streams import StoredStreams, settle
from tollgate_llm.domain import leases
from tollgate_llm.domain.capacity import Choice
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.prediction import RequestShape
from tollgate_llm.domain.requests.decide import AskToPreempt, Command, RejectRequest
from tollgate_llm.domain.requests.decide import decide as request_decide
from tollgate_llm.domain.requests.events import LeaseProgress
from tollgate_llm.domain.requests.evolve import evolve, evolve_event
from tollgate_llm.domain.requests.state import INITIAL, RequestState
from tollgate_llm.domain.types import CancelReason
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.usage import Progress
from tollgate_llm.ledger.commands import CommandHandler
from tollgate_llm.ledger.errors import StoreBusy, StoreUnavailable, WrongExpectedVersion
from tollgate_llm.ledger.ids import Clock, IdSource
from tollgate_llm.ledger.store import AppendBatch, AppendResult, NewEvent
from tollgate_llm.ledger.writer import WriterOverloaded

if TYPE_CHECKING:
    from tollgate_llm.api.services.tracing import RequestTrace

log = logging.getLogger("tollgate.edge")

# A request's events the store could not take are sent again, at most this long apart, for as
# long as the sweeper would leave the request open (tests/faults/edge_child.py sets it to 0).
APPEND_RETRY_MAX_S = 2.0
APPEND_RETRY_FOR_S = leases.LEASE_TTL_S
_STORE_AWAY = (StoreUnavailable, StoreBusy, WriterOverloaded)


@dataclass(slots=True)
class Flight:
    """One admitted request on this edge: its stream as decided so far, what the engine has
    reported, and the replica serving it."""

    request_id: str
    tenant_id: str
    model: str
    tier: str
    progress: Progress
    choice: Choice[Replica]
    idempotency_key: str | None = None
    # What the output predictor was asked about (None: no predictor), told the outcome at the end.
    shape: RequestShape | None = None
    state: RequestState = INITIAL
    finished: bool = False
    # Decided but not yet submitted (the first-token event rides with the next append), with
    # the commands that produced them, in case the append loses a race and must be decided again.
    pending: list[NewEvent] = field(default_factory=list)
    pending_commands: list[Command] = field(default_factory=list)
    pending_from: int = 0  # the stream version the pending events follow
    service_tier: str = "default"
    # The engine exchange serving it (set once opened), so that another request can preempt it,
    # and for a stream the task that writes to its client.
    exchange: ChatExchange | None = None
    owner: asyncio.Task[Any] | None = None
    preempted_for: str | None = None  # the interactive request this flex one was preempted for
    # Why the edge cancelled it, when the client did not leave by itself (None: it did).
    cancel_reason: CancelReason | None = None
    dropped: bool = False  # its client connection was dropped (a slow reader that stayed so)
    # Its counts as this edge last renewed them (None: never): a renewal carries only the
    # requests whose counts moved since.
    renewed: leases.Counts | None = None
    # A stream's first-token event, staged (`first_staged`) until the stream sends its first
    # frame or ends, whichever comes first, then committing (`first_durable`): no frame is sent
    # before that commit. And the terminal event's, once ended: the final usage and [DONE] (a
    # JSON body) wait for that one.
    first_staged: bool = False
    first_durable: asyncio.Future[bool] | None = None
    ended: asyncio.Future[bool] | None = None
    trace: RequestTrace | None = None  # its spans, when tracing is on (api/services/tracing.py)
    retention: str = ""  # its retention tier: "zero" keeps no response for a replay


class Recorder:
    def __init__(
        self,
        sink: EventSink,
        metrics: Metrics,
        *,
        clock: Clock,
        new_id: IdSource,
        commands: CommandHandler | None = None,
    ) -> None:
        self.sink = sink
        self.metrics = metrics
        self.clock = clock
        self.new_id = new_id
        # Decides again on the stored stream after a lost race; None (tests without a store):
        # a lost race is counted as a failed append.
        self.stored = None if commands is None else StoredStreams(commands, metrics, clock=clock)

    # --- request streams ---------------------------------------------------------------------

    def stage(self, flight: Flight, *commands: Command) -> None:
        """Decide `commands` on the flight's state and keep their events for its next append."""
        if not flight.pending:
            flight.pending_from = flight.state.version
        at = self.clock()
        for command in commands:
            for event in request_decide(flight.state, command):
                flight.pending.append(
                    NewEvent(self.new_id(), flight.request_id, flight.tenant_id, at, event)
                )
                flight.state = evolve_event(flight.state, event, at)
            flight.pending_commands.append(command)

    def commit(self, flight: Flight, *commands: Command) -> asyncio.Future[AppendResult]:
        """Decide and commit with this loop iteration's group; the future is its commit."""
        self.stage(flight, *commands)
        return self.sink.commit(self._take(flight))

    def record(
        self, flight: Flight, *commands: Command, now: bool = False
    ) -> asyncio.Future[bool]:
        """Decide and record; the future says whether it became durable (True once committed,
        after the retries of a store that was away or a decision taken again on the stored
        stream; False when it was not recorded). Nobody need wait for it: the batch shares the
        next group's commit (`now`: this loop iteration's, for what a client waits on)."""
        self.stage(flight, *commands)
        return self.flush(flight, now=now)

    def flush(self, flight: Flight, *, now: bool = False) -> asyncio.Future[bool]:
        """Submit what is staged (nothing when nothing is); the future as `record`'s."""
        durable: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if flight.pending:
            commands = tuple(flight.pending_commands)
            self._submit(flight, self._take(flight), commands, 0.0, durable, now)
            if flight.first_staged:  # whoever submits it (the end, a renewal), it is this commit
                flight.first_staged = False
                flight.first_durable = durable
        else:
            durable.set_result(True)
        return durable

    def _submit(
        self, flight: Flight, batch: AppendBatch, commands: Sequence[Command],
        waited_s: float, durable: asyncio.Future[bool], now: bool = False,
    ) -> None:  # fmt: skip
        future = self.sink.commit(batch) if now else self.sink.later(batch)
        future.add_done_callback(
            lambda f: self._committed(f, flight, batch, commands, waited_s, durable)
        )

    def _take(self, flight: Flight) -> AppendBatch:
        batch = AppendBatch(flight.request_id, flight.pending_from, tuple(flight.pending))
        flight.pending = []
        flight.pending_commands = []
        return batch

    def observed(self, flight: Flight, record: Recorded) -> None:
        """Another writer's fact on a stream this edge serves (a PreemptionRequested), read from
        the log: taken into the flight's state when nothing is staged on top of it, so that the
        next append is at the right version. Otherwise that append loses the version race and
        is decided again on the stored stream, as after the sweeper."""
        if not flight.pending and record.stream_version == flight.state.version + 1:
            flight.state = evolve(flight.state, record)

    def ask(self, request_id: str, tenant_id: str, command: AskToPreempt) -> None:
        """Ask for the preemption of a flex request another edge serves (`StoredStreams.ask`)."""
        if self.stored is None:
            self.metrics.append_failures.inc()
            log.error(
                "no command handler: cannot ask for the preemption of %s", request_id,
                extra={"request_id": request_id, "tenant_id": tenant_id},
            )  # fmt: skip
            return
        self.stored.ask(request_id, tenant_id, command)

    # --- refusals and leases ----------------------------------------------------------------

    def reject(
        self, command: RejectRequest, tenant_id: str, at: datetime | None = None
    ) -> None:
        """A refusal is a fact too: decided, recorded (at `at`, default now), never silent."""
        events = request_decide(INITIAL, command)
        at = at or self.clock()
        new = tuple(NewEvent(self.new_id(), command.request_id, tenant_id, at, e) for e in events)
        self.sink.later(AppendBatch(command.request_id, 0, new)).add_done_callback(
            self._checked
        )

    def fact(
        self, stream_id: str, tenant_id: str, event: Event, expected_version: int | None,
        at: datetime | None = None,
    ) -> None:  # fmt: skip
        """A fact of another stream than a request's (a run's start or exhaustion), decided by
        the caller and recorded without waiting."""
        new = (NewEvent(self.new_id(), stream_id, tenant_id, at or self.clock(), event),)
        self.sink.later(AppendBatch(stream_id, expected_version, new)).add_done_callback(
            self._checked
        )

    def renew(self, edge_id: str, flights: Iterable[Flight], *, everyone: bool = True) -> None:
        """One LeasesRenewed for the requests this edge serves, with their engine counts: all
        of them (`everyone`, the keep-alive), or only those whose counts moved since their last
        renewal (none moved: nothing is written). What is staged rides along first."""
        live = [f for f in flights if not f.finished]
        for flight in live:
            if flight.pending:
                self.flush(flight)
            exchange = flight.exchange
            if exchange is not None and exchange.last_usage is not None:
                # What the engine reported, read or not by the client yet: the bill after a
                # crash of this edge is the engine's count as of this renewal.
                flight.progress.absorb_usage(exchange.last_usage)
        progress = [
            LeaseProgress(
                request_id=f.request_id, tenant_id=f.tenant_id,
                prompt_tokens=f.progress.prompt_tokens,
                completion_tokens=f.progress.completion_tokens,
                cached_tokens=f.progress.cached_tokens,
            )
            for f in live
        ]  # fmt: skip
        previous = None if everyone else {f.request_id: f.renewed for f in live if f.renewed}
        renewal = leases.renewal(edge_id, progress, previous)
        if renewal is None:
            return
        for flight, item in zip(live, progress, strict=True):
            flight.renewed = leases.counts(item)
        stream = leases.edge_stream(edge_id)
        new = NewEvent(self.new_id(), stream, "", self.clock(), renewal)
        future = self.sink.later(AppendBatch(stream, None, (new,)))
        future.add_done_callback(lambda f: self._renewal_committed(f, live))

    # --- outcomes -----------------------------------------------------------------------------

    def count(self, result: AppendResult) -> bool:
        """Count a commit's events (or its failure); True when it succeeded."""
        if result.ok:
            for r in result.records:
                self.metrics.events_of(r.type).inc()
            return True
        self.metrics.append_failures.inc()
        log.error("event append failed for %s: %s", result.stream_id, result.error)
        return False

    def _renewal_committed(
        self, future: asyncio.Future[AppendResult], flights: Sequence[Flight]
    ) -> None:
        result = self._result(future)
        if result is not None and self.count(result):
            return
        for flight in flights:  # not renewed after all: the next renewal carries them again
            flight.renewed = None

    def _checked(self, future: asyncio.Future[AppendResult]) -> None:
        result = self._result(future)
        if result is not None:
            self.count(result)

    def _committed(
        self,
        future: asyncio.Future[AppendResult],
        flight: Flight,
        batch: AppendBatch,
        commands: Sequence[Command],
        waited_s: float,
        durable: asyncio.Future[bool],
    ) -> None:
        if future.cancelled():
            settle(durable, False)
            return
        error = future.exception() or future.result().error
        if isinstance(error, _STORE_AWAY) and waited_s < APPEND_RETRY_FOR_S:
            # The store was away (a dropped connection, a failover): the same batch again, as
            # it was decided. If it had committed after all, the store answers it as the exact
            # retry it is. Given up once the sweeper would have expired the request anyway.
            delay = min(max(0.1, waited_s), APPEND_RETRY_MAX_S)
            self.metrics.append_retries.inc()
            asyncio.get_running_loop().call_later(
                delay, self._submit, flight, batch, commands, waited_s + delay, durable
            )
            return
        result = self._result(future)
        if result is None:
            settle(durable, False)
            return
        if isinstance(result.error, WrongExpectedVersion) and self.stored is not None:
            self.metrics.append_conflicts.inc()
            self.stored.decide_again(
                flight.request_id, flight.tenant_id, commands, result.error, durable
            )
            return
        settle(durable, self.count(result))

    def _result(self, future: asyncio.Future[AppendResult]) -> AppendResult | None:
        try:
            return future.result()
        except Exception as exc:  # the writer itself failed: counted and logged, loudly
            self.metrics.append_failures.inc()
            log.error("event append failed: %r", exc)
            return None
