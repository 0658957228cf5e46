"""The control plane (tenants, keys, limits, plans, prices, the fleet) folded from the store and
kept current: what the edges, the fold worker, the CLI and the back office all read."""

from __future__ import annotations

from tollgate_llm.domain.control_plane.state import CONTROL_PREFIXES, ControlView
from tollgate_llm.ledger.commands import StreamLoader
from tollgate_llm.ledger.store import EventStore

__all__ = ["ControlLog"]


class ControlLog:
    def __init__(self, store: EventStore, view: ControlView | None = None) -> None:
        self.store = store
        self.view = view or ControlView()
        # Position first, then the streams: a control event committed in between is read twice
        # (the view ignores a repeat), never missed.
        self.position = store.last_position()
        for record in store.read_streams_with_prefix(CONTROL_PREFIXES):
            self.view.apply(record)

    def follow(self) -> int:
        """Apply the control-plane records committed since the last call; returns the position
        scanned to.

        That is the log's end as read before the scan, not the last control record: requests'
        events far outnumber control ones, and each poll would otherwise scan again every event
        since the last key or price change (7 % of the edge's CPU ten seconds after start, and
        growing). Positions commit in order (the store's append lock), so every event up to the
        end read first is visible to the scan that follows."""
        end = self.store.last_position()
        position = self.position
        while records := self.store.read_all(position, 1000, stream_prefixes=CONTROL_PREFIXES):
            for record in records:
                self.view.apply(record)
            position = records[-1].position
        self.position = max(position, end)
        return self.position

    def loader(self, stream_id: str) -> StreamLoader[ControlView]:
        """For the command handler: the view, caught up, and the version of `stream_id` in it."""

        def load() -> tuple[ControlView, int]:
            self.follow()
            return self.view, self.view.stream_version(stream_id)

        return load
