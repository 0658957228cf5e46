"""The lease sweeper: a request whose edge stopped renewing it for `LEASE_TTL_S` is expired and
billed at its last known progress, so a dead edge holds a tenant's concurrency for seconds, not
for ever. The leases are `domain.leases.LeaseBook`'s fold; the verdict is
`domain.requests.decide`'s, recorded through the command handler (an edge that ended the
request meanwhile wins).

`GroupSweeper` runs it in a group of workers (the distributed mode's Kafka workers): one leads
at a time and hands over to another when it dies."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

import sqlalchemy as sa

from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.leases import LEASE_EVENT_TYPES, LEASE_TTL_S, Lease, LeaseBook
from tollgate_llm.domain.projections import REQUEST_LOG
from tollgate_llm.domain.requests.decide import ExpireLease
from tollgate_llm.domain.requests.decide import decide as request_decide
from tollgate_llm.domain.requests.events import TERMINAL_TYPES, RequestAdmitted
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.checkpoints import Checkpoints, read_position
from tollgate_llm.ledger.commands import CommandHandler, request_stream
from tollgate_llm.ledger.leadership import Leadership
from tollgate_llm.ledger.schema import events, request_log
from tollgate_llm.ledger.store import EventStore, SqlEventStore
from tollgate_llm.streams.sql_tail import SqlTail

log = logging.getLogger("tollgate.sweeper")

LIVE_STATUSES = ("admitted", "routed", "streaming")
# The job one worker of a group leads, and the checkpoint where its successor resumes.
SWEEPER_JOB = "lease-sweeper"
SWEEPER_RESUME = "lease-sweeper.resume"


class LeaseSweeper:
    def __init__(
        self,
        store: EventStore,
        ttl_s: float = LEASE_TTL_S,
        commands: CommandHandler | None = None,
        on_expired: Callable[[str], object] | None = None,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.commands = commands or CommandHandler(store)
        # Told each request id it expired, after the expiry is recorded (the worker frees the
        # request's Idempotency-Key there).
        self.on_expired = on_expired
        self.leases = LeaseBook()
        self.position = 0

    def start_from(self, position: int, in_flight: list[Recorded]) -> None:
        """Resume: `in_flight` are the admissions of requests not yet ended; tail from
        `position`."""
        for record in in_flight:
            self.leases.apply(record)
        self.position = position

    def apply(self, record: Recorded) -> None:
        self.leases.apply(record)

    def sweep(self, now: datetime) -> list[str]:
        """Expire every lease unrenewed for the TTL; returns the request ids it expired."""
        return [
            lease.request_id
            for lease in self.leases.expired(now, self.ttl_s)
            if self._expire(lease, now)
        ]

    def _expire(self, lease: Lease, now: datetime) -> bool:
        progress = lease.progress
        command = ExpireLease(
            request_id=lease.request_id,
            last_renewed_at=lease.renewed_at,
            prompt_tokens=progress.prompt_tokens if progress else 0,
            completion_tokens=progress.completion_tokens if progress else 0,
            cached_tokens=progress.cached_tokens if progress else 0,
        )

        def decide(state: RequestState) -> tuple[Event, ...]:
            # Ended meanwhile (the edge's terminal event is late in the log): nothing to expire.
            return () if state.is_terminal else request_decide(state, command)

        handled = self.commands.handle(
            lease.request_id,
            decide,
            request_stream(self.store, lease.request_id),
            tenant_id=lease.tenant_id,
            at=now,
        )
        faults.point("sweeper.after_expire", request_id=lease.request_id)
        self.leases.forget(lease.request_id)
        if not handled.events:
            return False
        if self.on_expired is not None:
            self.on_expired(lease.request_id)
        log.warning(
            "lease expired for %s (edge %s silent since %s)",
            lease.request_id,
            lease.edge_id,
            lease.renewed_at.isoformat(),
        )
        return True


def resume_sweeper(engine: sa.Engine, store: SqlEventStore, sweeper: LeaseSweeper) -> None:
    """Start the sweeper from the requests that have not ended (an edge may have died with
    requests in flight): their admissions, and the log from the oldest of them.

    The embedded worker calls it once its read models are folded to the end: `request_log`
    then says which requests are live up to the position its checkpoint names, and the tail
    reads from there on (not from the store's end: an admission committed after the read
    models' last fold and before that read would be in neither)."""
    with engine.connect() as conn:
        covered = read_position(conn, REQUEST_LOG.name) or 0
        live = [
            r[0]
            for r in conn.execute(
                sa.select(request_log.c.request_id).where(request_log.c.status.in_(LIVE_STATUSES))
            )
        ]
    _start(store, sweeper, live, covered)


def resume_from_store(engine: sa.Engine, store: SqlEventStore, sweeper: LeaseSweeper) -> None:
    """The same from the event store itself, for a group's first leader (a Kafka worker): its
    read models are folded from the topic, so `request_log` may lag the store, and a request
    admitted while the group started up (an edge admits before the workers are up) was in
    neither the read model nor the log read after it: its dead edge's requests were never
    expired, nor billed (issue 26). One scan of the admissions, once per group (a leader saves
    where its successor resumes)."""
    end = store.last_position()  # first: what is admitted after it, the tail reads
    admitted, ended = events.alias("admitted"), events.alias("ended")
    with engine.connect() as conn:
        live = list(
            conn.execute(
                sa.select(admitted.c.stream_id).where(
                    admitted.c.type == RequestAdmitted.EVENT_TYPE,
                    admitted.c.position <= end,
                    ~sa.exists().where(
                        ended.c.stream_id == admitted.c.stream_id,
                        ended.c.type.in_(sorted(TERMINAL_TYPES)),
                    ),
                )
            ).scalars()
        )
    _start(store, sweeper, live, end)


def _start(store: SqlEventStore, sweeper: LeaseSweeper, live: list[str], covered: int) -> None:
    admissions = [
        record
        for request_id in live
        for record in store.read_stream(request_id)
        if isinstance(record.event, RequestAdmitted)
    ]
    oldest = min((r.position - 1 for r in admissions), default=covered)
    sweeper.start_from(min(oldest, covered), admissions)


class GroupSweeper:
    """The lease sweeper of a group of workers over one store, led by one of them at a time
    (`ledger.leadership`): with each worker following the whole store, the group's reads and
    decoding of it grew with every worker added.

    The leader saves where a successor must read the log from to fold its lease book again
    (`LeaseBook.resume_position`: just before the oldest open lease's admission; the group's
    first leader starts from the store's admissions without a terminal, `resume_from_store`).
    So a worker that takes over after the leader died holds the same leases, renewed at the
    same instants with
    the same progress, and expires them as the leader would have. Two leading at once (one
    whose session was lost and who has not noticed yet) only repeats work: the command handler
    lets exactly one expiry of a request win."""

    def __init__(
        self,
        engine: sa.Engine,
        store: SqlEventStore,
        *,
        name: str,
        ttl_s: float = LEASE_TTL_S,
        on_expired: Callable[[str], object] | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.ttl_s = ttl_s
        self.on_expired = on_expired
        self.leadership = Leadership(engine, SWEEPER_JOB)
        self.checkpoints = Checkpoints(engine)
        # Only what the lease book folds: decoding the rest of the store (routing, first tokens,
        # bills) was most of a worker's CPU at load.
        self.tail = SqlTail(store, engine, f"{name}-leases", event_types=LEASE_EVENT_TYPES)
        self.sweeper = LeaseSweeper(store, ttl_s, on_expired=on_expired)
        self.leading = False
        self._saved: int | None = None

    @property
    def position(self) -> int:
        return self.sweeper.position

    def lead(self) -> bool:
        """Whether this worker leads the sweeper now; on taking the lead, fold the book again
        from where the last leader left it."""
        if not self.leadership.held():
            self.leading = False
            return False
        if not self.leading:
            saved = self.checkpoints.find(SWEEPER_RESUME)
            self.sweeper = LeaseSweeper(self.store, self.ttl_s, on_expired=self.on_expired)
            if saved is None:
                resume_from_store(self.engine, self.store, self.sweeper)
            else:
                self.sweeper.start_from(saved, [])
            self.tail.seek(self.sweeper.position)
            self._saved = saved
            self.leading = True
        return True

    def step(self, now: datetime) -> list[str]:
        """As the leader: follow the store's new events into the lease book, expire the silent
        leases, save where a successor would resume; returns the request ids it expired. A
        standby does nothing."""
        if not self.lead():
            return []
        self.follow()
        expired = self.sweeper.sweep(now)
        resume = self.sweeper.leases.resume_position(self.sweeper.position)
        if resume != self._saved:
            self.checkpoints.set(SWEEPER_RESUME, resume)
            self._saved = resume
        return expired

    def follow(self) -> None:
        while True:
            batch = self.tail.poll(5000, 0)
            for d in batch.deliveries:
                self.sweeper.apply(d.record)
            if 0 in batch.next_offsets:
                self.sweeper.position = batch.next_offsets[0]
            if len(batch) < 5000:
                break

    def release(self) -> None:
        self.leadership.release()
        self.leading = False
