"""What every stream's events share: the `Event` base (a type name and a version) and the
`Recorded` envelope the folds read.

Events are frozen dataclasses of primitives (str, int, bool, None, UTC datetime, tuples). Money is
integer micro-units, KV usage integer byte-seconds, durations integer ms/us: never a float.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar


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
