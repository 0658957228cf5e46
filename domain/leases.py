"""Leases on in-flight requests (DESIGN §5): an edge renews every request it is serving with one
`LeasesRenewed` per interval, carrying each one's engine-reported progress; a request whose lease
has not been renewed for `LEASE_TTL_S` is expired by the sweeper and billed that progress, so a
dead edge holds a tenant's concurrency for seconds, not for ever.

`LeaseBook` is the fold both the sweeper and any in-flight view run: admissions open a lease,
renewals move it on, a terminal event closes it. Redelivery and reordering are harmless (a
renewal older than the one applied, or a repeated admission, changes nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    LeaseProgress,
    LeasesRenewed,
    RequestAdmitted,
)

# The renewal interval and the time without one after which a lease expires. What a crashed
# edge leaves unbilled of what its clients saw is what the engine reported after its last
# renewal: one interval of generation (plus the renewal's commit). At 0.5 s that was 0.784 of
# the client-seen tokens billed on a mixed profile (issue 26; at 5 s, 1,107 of 1,485 on long
# streams, issue 14 hole 5), so the edge renews every 0.1 s. It stays one event per edge per
# interval whatever the number of its streams, and it carries only the streams whose counts
# moved since the last one (`renewal(previous=...)`); an interval where none did writes nothing.
# Every `LEASE_KEEPALIVE_S` it carries them all, so a stream waiting in the engine's queue
# keeps its lease. The TTL stays 15 s, thirty keep-alives: a stalled event loop or a slow commit
# never expires a live request.
LEASE_RENEW_S: Final = 0.1
LEASE_KEEPALIVE_S: Final = 0.5
LEASE_TTL_S: Final = 15

_TERMINALS: Final = frozenset(TERMINAL_EVENTS)
# The only event types `LeaseBook.apply` folds: a tail feeding it reads nothing else.
_LEASE_EVENTS: Final[tuple[type[Event], ...]] = (RequestAdmitted, LeasesRenewed, *TERMINAL_EVENTS)
LEASE_EVENT_TYPES: Final = frozenset(cls.EVENT_TYPE for cls in _LEASE_EVENTS)


def edge_stream(edge_id: str) -> str:
    """The stream an edge's renewals are appended to."""
    return f"edge-{edge_id}"


Counts = tuple[int, int, int]


def counts(progress: LeaseProgress) -> Counts:
    return (progress.prompt_tokens, progress.completion_tokens, progress.cached_tokens)


def renewal(
    edge_id: str,
    progress: Iterable[LeaseProgress],
    previous: Mapping[str, Counts] | None = None,
) -> LeasesRenewed | None:
    """The renewal of the requests an edge serves, in one event (whatever their number): all of
    them, or with `previous` (each request's counts as last renewed) only those whose counts
    moved since. None when that leaves nothing to renew."""
    items = tuple(progress)
    if previous is not None:
        items = tuple(i for i in items if previous.get(i.request_id) != counts(i))
    for item in items:
        if min(item.prompt_tokens, item.completion_tokens, item.cached_tokens) < 0:
            raise DomainError("negative_tokens", f"negative progress for {item.request_id}")
    return LeasesRenewed(edge_id, items) if items else None


@dataclass(slots=True)
class Lease:
    request_id: str
    tenant_id: str
    edge_id: str
    renewed_at: datetime
    progress: LeaseProgress | None = None  # the last engine counts an edge renewed it with
    admitted_position: int = 0  # the log position of its admission


class LeaseBook:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def apply(self, recorded: Recorded) -> None:
        event = recorded.event
        kind = type(event)
        if kind is RequestAdmitted:
            assert isinstance(event, RequestAdmitted)
            if event.request_id not in self._leases:
                self._leases[event.request_id] = Lease(
                    event.request_id, event.tenant_id, event.edge_id, recorded.occurred_at,
                    admitted_position=recorded.position,
                )
        elif kind is LeasesRenewed:
            assert isinstance(event, LeasesRenewed)
            at = recorded.occurred_at
            for progress in event.progress:
                lease = self._leases.get(progress.request_id)
                if lease is not None and at >= lease.renewed_at:
                    lease.renewed_at = at
                    lease.edge_id = event.edge_id
                    lease.progress = progress
        elif kind in _TERMINALS:
            self._leases.pop(recorded.stream_id, None)

    def expired(self, now: datetime, ttl_s: float = LEASE_TTL_S) -> list[Lease]:
        """Leases not renewed for `ttl_s` or more, oldest first."""
        horizon = now - timedelta(seconds=ttl_s)
        return sorted(
            (lease for lease in self._leases.values() if lease.renewed_at <= horizon),
            key=lambda lease: lease.renewed_at,
        )

    def resume_position(self, tail_position: int) -> int:
        """Where a sweeper that takes over from this book reads the log from to fold the same
        book again, renewals included: just before the oldest open lease's admission, or the
        position this book was folded to when none is open."""
        oldest = min((lease.admitted_position for lease in self._leases.values()), default=None)
        return tail_position if oldest is None else min(oldest - 1, tail_position)

    def forget(self, request_id: str) -> None:
        self._leases.pop(request_id, None)

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests holding a lease."""
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases
