"""The lease sweeper: a request whose edge stopped renewing it for 15 s is expired and billed at
its last known progress, so a dead edge holds a tenant's concurrency for 15 s, not for ever."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from domain import lifecycle
from domain.events import (
    TERMINAL_EVENTS,
    LeasesRenewed,
    Recorded,
    RequestAdmitted,
)
from ledger.store import EventStore, NewEvent, WrongExpectedVersion

log = logging.getLogger("tollgate.sweeper")
TERMINAL_TYPES = frozenset(cls.EVENT_TYPE for cls in TERMINAL_EVENTS)


@dataclass(slots=True)
class Lease:
    request_id: str
    tenant_id: str
    edge_id: str
    renewed_at: datetime
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class LeaseSweeper:
    def __init__(self, store: EventStore, ttl_s: float = 15.0) -> None:
        self.store = store
        self.ttl = timedelta(seconds=ttl_s)
        self.leases: dict[str, Lease] = {}
        self.position = 0
        self.expired_total = 0

    def start_from(self, position: int, in_flight: list[Recorded]) -> None:
        """Resume: `in_flight` are the admissions of requests not yet ended; tail from
        `position`."""
        for record in in_flight:
            self.apply(record)
        self.position = position

    def apply(self, record: Recorded) -> None:
        event = record.event
        if isinstance(event, RequestAdmitted):
            self.leases[event.request_id] = Lease(
                event.request_id, event.tenant_id, event.edge_id, record.occurred_at
            )
        elif isinstance(event, LeasesRenewed):
            for p in event.progress:
                lease = self.leases.get(p.request_id)
                if lease is not None:
                    lease.renewed_at = record.occurred_at
                    lease.prompt_tokens = p.prompt_tokens
                    lease.completion_tokens = p.completion_tokens
                    lease.cached_tokens = p.cached_tokens
        elif record.type in TERMINAL_TYPES:
            self.leases.pop(record.stream_id, None)

    def sweep(self, now: datetime) -> list[str]:
        expired = []
        for lease in list(self.leases.values()):
            if now - lease.renewed_at >= self.ttl and self._expire(lease, now):
                expired.append(lease.request_id)
        return expired

    def _expire(self, lease: Lease, now: datetime) -> bool:
        for _ in range(3):
            state = lifecycle.fold(self.store.read_stream(lease.request_id))
            if state.is_terminal:
                self.leases.pop(lease.request_id, None)
                return False
            command = lifecycle.ExpireLease(
                request_id=lease.request_id,
                last_renewed_at=lease.renewed_at,
                prompt_tokens=lease.prompt_tokens,
                completion_tokens=lease.completion_tokens,
                cached_tokens=lease.cached_tokens,
            )
            events = [
                NewEvent(str(uuid.uuid4()), lease.request_id, lease.tenant_id, now, e)
                for e in lifecycle.decide(state, command)
            ]
            try:
                self.store.append(lease.request_id, state.version, events)
            except WrongExpectedVersion:
                continue  # the edge wrote meanwhile; look again
            self.leases.pop(lease.request_id, None)
            self.expired_total += 1
            log.warning(
                "lease expired for %s (edge %s silent since %s)",
                lease.request_id,
                lease.edge_id,
                lease.renewed_at.isoformat(),
            )
            return True
        return False
