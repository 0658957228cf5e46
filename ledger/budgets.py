"""The edge's path view (`domain.governance.budgets.PathView`) caught up from the log when it
starts: the requests reserved against a budget or a run in the current calendar month (in any
time zone)
are folded with their terminal events, refunds and bills, so a restart forgets no spend."""

from __future__ import annotations

from datetime import datetime, timedelta

from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.requests.events import BudgetReserved
from tollgate_llm.ledger.store import EventStore

__all__ = ["catch_up"]

# A month in the furthest time zone began at most 31 days + 14 h before now.
_HORIZON = timedelta(days=32)
_STREAMS_PER_READ = 500


def catch_up(store: EventStore, view: PathView, now: datetime) -> int:
    """Fold every request stream holding a BudgetReserved since the horizon; returns how many."""
    ids = store.streams_with(BudgetReserved.EVENT_TYPE, now - _HORIZON, now + timedelta(days=1))
    for start in range(0, len(ids), _STREAMS_PER_READ):
        streams = store.read_streams(ids[start : start + _STREAMS_PER_READ])
        for stream_id in ids[start : start + _STREAMS_PER_READ]:
            for record in streams.get(stream_id, ()):
                view.apply(record)
    return len(ids)
