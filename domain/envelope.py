"""What every stream's events share: the `Event` base (a type name and a version) and the
`Recorded` envelope the folds read.

Events are frozen dataclasses of primitives (str, int, bool, None, UTC datetime, tuples). Money is
integer micro-units, KV usage integer byte-seconds, durations integer ms/us: never a float.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, Final


class Event:
    """Base of every event payload. Subclasses set EVENT_TYPE and EVENT_VERSION."""

    EVENT_TYPE: ClassVar[str]
    EVENT_VERSION: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class Recorded:
    """An event as stored: the envelope the folds read. `position` is global commit order
    (0 before the store assigned it); `stream_version` counts from 1 within the stream."""

    event_id: str
    stream_id: str
    stream_version: int
    tenant_id: str
    occurred_at: datetime
    event: Event
    position: int = 0

    @property
    def type(self) -> str:
        return self.event.EVENT_TYPE


def _recorded_maker() -> Callable[..., Recorded]:
    new = object.__new__
    names = ("event_id", "stream_id", "stream_version", "tenant_id", "occurred_at", "event")
    s0, s1, s2, s3, s4, s5, s6 = (getattr(Recorded, n).__set__ for n in (*names, "position"))

    def recorded(
        event_id: str, stream_id: str, stream_version: int, tenant_id: str,
        occurred_at: datetime, event: Event, position: int = 0,
    ) -> Recorded:  # fmt: skip
        r: Recorded = new(Recorded)
        s0(r, event_id)
        s1(r, stream_id)
        s2(r, stream_version)
        s3(r, tenant_id)
        s4(r, occurred_at)
        s5(r, event)
        s6(r, position)
        return r

    return recorded


# `Recorded(...)` by position, its slots set directly: the frozen dataclass's __init__ sets each
# field through object.__setattr__ (twice the cost), and every event a fold reads is one.
new_recorded: Final = _recorded_maker()
