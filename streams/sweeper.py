"""The lease sweeper: a request whose edge stopped renewing it for `LEASE_TTL_S` is expired and
billed at its last known progress, so a dead edge holds a tenant's concurrency for seconds, not
for ever. The leases are `domain.leases.LeaseBook`'s fold; the verdict is `lifecycle.decide`'s,
recorded through the command handler (an edge that ended the request meanwhile wins)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from domain import lifecycle
from domain.events import Event, Recorded
from domain.leases import LEASE_TTL_S, Lease, LeaseBook
from ledger import faults
from ledger.commands import CommandHandler, request_stream
from ledger.store import EventStore

log = logging.getLogger("tollgate.sweeper")


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
        command = lifecycle.ExpireLease(
            request_id=lease.request_id,
            last_renewed_at=lease.renewed_at,
            prompt_tokens=progress.prompt_tokens if progress else 0,
            completion_tokens=progress.completion_tokens if progress else 0,
            cached_tokens=progress.cached_tokens if progress else 0,
        )

        def decide(state: lifecycle.RequestState) -> tuple[Event, ...]:
            # Ended meanwhile (the edge's terminal event is late in the log): nothing to expire.
            return () if state.is_terminal else lifecycle.decide(state, command)

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
