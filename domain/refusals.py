"""Which refusals are recorded one by one, and which are only counted (issue 27).

A refused request costs the caller nothing, so a key over its limit can send refusals as fast as
it likes; recorded one by one, each was a `RequestRejected` event and a `request_log` row (909
bytes together), 4.5 MB for 5,000 refusals in 11 s. The first refusals of a key in each
`window_s` window are still recorded in full — support's "why was I refused" has its request id,
reason and detail — as many as the key's plan admits requests in a minute (at least
`min_full_per_window`), so a key's refusals never store more than its admitted requests could;
the rest are counted, per (tenant, model, tier, reason), and recorded once the window has closed
as one `RefusalsCounted` with the count. Goodput and the request log count them all, so nothing
becomes uncountable; what a sustained flood stores per key is bounded per window whatever its
rate.

Pure: the edge asks, per refusal, and collects the closed windows on its lease tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

REFUSAL_WINDOW_S: Final = 60
MIN_FULL_REFUSALS_PER_WINDOW: Final = 10


@dataclass(frozen=True, slots=True)
class CountedRefusals:
    """One `RefusalsCounted` to record: `count` refusals of `key_id` in the window."""

    tenant_id: str
    key_id: str
    model: str
    tier: str
    reason: str
    window_start: datetime
    window_s: int
    count: int


@dataclass(slots=True)
class _KeyWindow:
    start: int  # the window's first second (Unix), a multiple of window_s
    full: int = 0  # refusals recorded in full so far
    counted: dict[tuple[str, str, str, str], int] = field(default_factory=dict)


class RefusalSampler:
    """Per key, the current window: how many refusals were recorded in full, and the counts of
    the rest. Memory: one entry per key refused in the current window (keys are issued by
    operators, so this is bounded by the keys that exist)."""

    def __init__(
        self,
        min_full_per_window: int = MIN_FULL_REFUSALS_PER_WINDOW,
        window_s: int = REFUSAL_WINDOW_S,
    ) -> None:
        if min_full_per_window < 0 or window_s <= 0:
            raise ValueError("min_full_per_window >= 0 and window_s > 0")
        self.min_full_per_window = min_full_per_window
        self.window_s = window_s
        self._keys: dict[str, _KeyWindow] = {}
        self._closed: list[CountedRefusals] = []

    def record_in_full(
        self,
        key_id: str,
        tenant_id: str,
        model: str,
        tier: str,
        reason: str,
        now: datetime,
        per_window: int = 0,
    ) -> bool:
        """Whether this refusal is recorded one by one (True) or only counted (False): the first
        `max(per_window, min_full_per_window)` of the key's window are. `model` is counted as
        given: pass one Tollgate knows ("" for a name the client made up)."""
        start = int(now.timestamp()) // self.window_s * self.window_s
        window = self._keys.get(key_id)
        if window is None or window.start != start:
            if window is not None:
                self._close(key_id, window)
            window = self._keys[key_id] = _KeyWindow(start)
        if window.full < max(per_window, self.min_full_per_window):
            window.full += 1
            return True
        counted = (tenant_id, model, tier, reason)
        window.counted[counted] = window.counted.get(counted, 0) + 1
        return False

    def closed(self, now: datetime) -> list[CountedRefusals]:
        """The counts of every window that has ended by `now`, once each; forgets those keys."""
        start = int(now.timestamp()) // self.window_s * self.window_s
        for key_id in [k for k, w in self._keys.items() if w.start < start]:
            self._close(key_id, self._keys.pop(key_id))
        out, self._closed = self._closed, []
        return out

    def drain(self) -> list[CountedRefusals]:
        """Every count held, the current windows' too (an edge shutting down)."""
        for key_id in list(self._keys):
            self._close(key_id, self._keys.pop(key_id))
        out, self._closed = self._closed, []
        return out

    def __len__(self) -> int:
        return len(self._keys)

    def _close(self, key_id: str, window: _KeyWindow) -> None:
        at = datetime.fromtimestamp(window.start, UTC)
        for (tenant_id, model, tier, reason), count in window.counted.items():
            self._closed.append(
                CountedRefusals(tenant_id, key_id, model, tier, reason, at, self.window_s, count)
            )
