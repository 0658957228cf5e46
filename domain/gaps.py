"""The continuous reconciliation's fold (DESIGN §4 invariant 14, every gap alarms): the terminal
events whose ledger row has not been seen yet, and the admitted requests that hold a lease no edge
renews and no sweeper ended.

It is folded apart from the folds it watches, from the log itself: a billing fold that skipped a
record, a consumer that moved past a batch it never applied, or a sweeper that stopped all leave
the log and the ledger disagreeing, and that disagreement is what this book measures. Billing is
exact when both figures are zero past their grace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.leases import LEASE_TTL_S, LeaseBook
from tollgate_llm.domain.requests.events import TERMINAL_EVENTS

__all__ = ["OVERDUE_GRACE_S", "GapBook", "GapReport"]

_TERMINALS: Final = frozenset(TERMINAL_EVENTS)
# A lease is overdue once the sweeper has had this long past the TTL to expire it: the sweepers
# run every 0.5 s and expired the edge-crash tests' leases 15.0-15.1 s after their last renewal,
# so 10 s is many sweeps, and an admitted request without its terminal event past TTL + 10 s is
# one that nothing is going to end.
OVERDUE_GRACE_S: Final = 10.0
SAMPLE: Final = 3  # request ids a report names


@dataclass(frozen=True, slots=True)
class GapReport:
    unbilled_terminals: int  # terminal events whose ledger row has not been seen
    oldest_unbilled_at: datetime | None  # the oldest such terminal event's instant
    overdue_leases: int  # admitted, not ended, unrenewed past the TTL and the grace
    oldest_overdue_at: datetime | None  # the last renewal (or admission) of the oldest
    unbilled_sample: tuple[str, ...] = ()
    overdue_sample: tuple[str, ...] = ()


class GapBook:
    """Fold lease events (`domain.leases.LEASE_EVENT_TYPES`: admissions, renewals, terminal
    events) with `apply`, tell it which requests have their ledger row with `posted`, and ask
    `report`. Redelivery is harmless: a terminal event seen twice is one pending bill, and a
    request posted is never pending again (its terminal event is older than the resume
    position a caller saves, see `resume_position`)."""

    def __init__(self) -> None:
        self.leases = LeaseBook()
        # request id -> (log position, instant) of its terminal event, oldest first.
        self._unbilled: dict[str, tuple[int, datetime]] = {}

    def apply(self, recorded: Recorded) -> None:
        self.leases.apply(recorded)
        if type(recorded.event) in _TERMINALS:
            self._unbilled.setdefault(recorded.stream_id, (recorded.position, recorded.occurred_at))

    def pending(self) -> list[str]:
        """The requests whose terminal event awaits its ledger row, oldest first."""
        return list(self._unbilled)

    def __len__(self) -> int:
        return len(self._unbilled)

    def posted(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._unbilled.pop(request_id, None)

    def report(
        self, now: datetime, *, ttl_s: float = LEASE_TTL_S, grace_s: float = OVERDUE_GRACE_S
    ) -> GapReport:
        unbilled = sorted(self._unbilled.items(), key=lambda item: item[1][1])
        overdue = self.leases.expired(now, ttl_s + grace_s)
        return GapReport(
            unbilled_terminals=len(unbilled),
            oldest_unbilled_at=unbilled[0][1][1] if unbilled else None,
            overdue_leases=len(overdue),
            oldest_overdue_at=overdue[0].renewed_at if overdue else None,
            unbilled_sample=tuple(rid for rid, _ in unbilled[:SAMPLE]),
            overdue_sample=tuple(lease.request_id for lease in overdue[:SAMPLE]),
        )

    def resume_position(self, tail_position: int) -> int:
        """Where a reconciler that restarts reads the log from to fold the same book: before the
        oldest open lease's admission and the oldest pending terminal event."""
        oldest = min((position for position, _ in self._unbilled.values()), default=None)
        resume = self.leases.resume_position(tail_position)
        return resume if oldest is None else min(resume, oldest - 1)


def age_s(now: datetime, then: datetime | None) -> float:
    """Seconds from `then` to `now` (0 for None or a future instant)."""
    if then is None:
        return 0.0
    return max(0.0, (now - then) / timedelta(seconds=1))
