"""The router's quality view (domain.routing.QualityView) folded from the log's FeedbackRecorded
events and kept current: what every edge's admission reads to route `auto` requests."""

from __future__ import annotations

from tollgate_llm.domain.requests.events import FeedbackRecorded
from tollgate_llm.domain.routing import QualityView
from tollgate_llm.ledger.store import EventStore

__all__ = ["QualityLog"]

_TYPES = (FeedbackRecorded.EVENT_TYPE,)


class QualityLog:
    def __init__(self, store: EventStore, view: QualityView | None = None) -> None:
        self.store = store
        self.view = view or QualityView()
        self.position = 0
        self.follow()

    def follow(self) -> int:
        """Fold the feedback committed since the last call; returns the position scanned to:
        the log's end as read before the scan (as ControlLog.follow, and for its reason: feedback
        is rare beside requests' events, and each poll must not scan again all since the last)."""
        end = self.store.last_position()
        position = self.position
        while records := self.store.read_all(position, 1000, event_types=_TYPES):
            for record in records:
                self.view.apply(record)
            position = records[-1].position
        self.position = max(position, end)
        return self.position
