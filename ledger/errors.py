"""Errors of the persistence layer. Each message is one line a human can act on."""

from __future__ import annotations

from collections.abc import Sequence


class StoreError(Exception):
    """Base of every ledger error."""


class BadDatabaseUrl(StoreError):
    """The database URL is malformed or names a backend Tollgate does not support."""


class StoreUnavailable(StoreError):
    """The database cannot be reached (down, wrong host, missing directory)."""


class StoreBusy(StoreError):
    """`try_append_many` found the database's write lock taken; nothing was written."""


class WrongExpectedVersion(StoreError):
    """Optimistic concurrency: the stream has `actual` events, the caller expected `expected`."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, expected {expected}: "
            "someone else appended first; reload the stream and decide again"
        )
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


class EventIdConflict(StoreError):
    """An event id is already recorded with different content. `fields` names what differs
    (payload fields as "payload.<name>"); a retry must resend exactly what was recorded."""

    def __init__(self, event_id: str, fields: Sequence[str], detail: str = "") -> None:
        names = ", ".join(fields)
        super().__init__(
            f"event {event_id} is already recorded with different {names}"
            + (f" ({detail})" if detail else "")
        )
        self.event_id = event_id
        self.fields = tuple(fields)


class ProjectionError(StoreError):
    """A projection produced a row it may not write (wrong columns, key moved)."""
