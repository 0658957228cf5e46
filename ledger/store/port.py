"""The event store port: `EventStore` (its docstring is the contract every implementation
passes) and the values that cross it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.ledger.errors import StoreError


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event about to be appended. The caller owns `event_id` (a UUID string): it is what
    makes a retried append harmless."""

    event_id: str
    stream_id: str
    tenant_id: str
    occurred_at: datetime  # timezone-aware; stored as UTC
    event: Event


@dataclass(frozen=True, slots=True)
class AppendBatch:
    """One stream append: all of `events` land together or none do."""

    stream_id: str
    expected_version: int | None
    events: Sequence[NewEvent]


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The outcome of one batch of an `append_many`. `duplicate` is True when every event was
    already recorded and nothing was written (the records are the stored ones)."""

    stream_id: str
    records: list[Recorded] = field(default_factory=list)
    error: StoreError | None = None
    duplicate: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> list[Recorded]:
        if self.error is not None:
            raise self.error
        return self.records


class EventStore(Protocol):
    """The append-only log of every fact Tollgate records.

    Contract (every implementation passes tests/contracts/test_event_store.py):

    - `append(stream_id, expected_version, events)` is all-or-nothing. `expected_version` is the
      number of events already in the stream: 0 means the stream must not exist yet, None skips
      the check. The events get stream versions expected+1, expected+2, ... and increasing global
      positions. If the stream is not at `expected_version` it raises WrongExpectedVersion(
      stream_id, expected, actual); two concurrent appends at the same version: exactly one wins.
    - Idempotent on `event_id`: re-appending events that are all recorded with identical content
      (stream, tenant, instant, type, version, payload) writes nothing and returns the stored
      records, whatever `expected_version` says. The same id with different content raises
      EventIdConflict naming the differing fields; a batch mixing recorded and new ids raises
      EventIdConflict too (the original append was all-or-nothing, so this is not a retry).
    - `append_many(batches)` commits many independent appends together (group commit). Each
      batch succeeds or fails on its own; a conflict in one never sinks the others. Batches are
      applied in order, so two batches for one stream see each other.
    - `read_stream` returns a stream in version order (with `tenant_id`, only that tenant's
      events: another tenant's stream reads as empty, as an unknown one does, filtered in the
      same query); `read_all(after_position, limit)` returns events in global position order.
      A reader that tails `read_all` by the last position it saw never skips an event, even one
      whose transaction commits late (PostgreSQL hides events of transactions newer than the
      oldest one still running, and appends take positions in commit order).
    - `read_streams_with_prefix(prefix)` returns every event of every stream whose id starts
      with `prefix` (or with any of a sequence of prefixes), in position order.
    - `read_streams(stream_ids)` returns each of those streams (version order), keyed by id;
      a missing stream is absent. `read_stream_window(stream_id, after, before)` returns the
      events of one stream with after < position < before, in position order (a slice of a
      long stream, e.g. an edge's renewals during one request).
    - `streams_with(event_type, occurred_from, occurred_to)` returns the ids of the streams
      holding an event of that type that occurred in [occurred_from, occurred_to), in position
      order (finance: the requests admitted in a period); with `tenant_id`, that tenant's only.
    - `last_position()` is the position a tailing reader can reach now (0 for an empty store);
      `stream_version(stream_id)` is 0 for a missing stream.
    - Events are never updated or deleted.
    """

    def append(
        self, stream_id: str, expected_version: int | None, events: Sequence[NewEvent]
    ) -> list[Recorded]: ...

    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]: ...

    def read_stream(self, stream_id: str, tenant_id: str | None = None) -> list[Recorded]: ...

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = (),
        event_types: Sequence[str] = (), known: Mapping[int, Recorded] | None = None,
    ) -> list[Recorded]:
        """`known`: records the caller already holds, by position (what its own appends
        returned); a store may give them back as they are instead of decoding them again."""
        ...  # fmt: skip

    def read_tail(
        self, after_position: int, limit: int, event_types: Sequence[str],
        excluding_id_suffix: str = "",
    ) -> tuple[list[Recorded], int]:
        """A follower's read: the events after `after_position` of `event_types`, less those
        whose event id ends with `excluding_id_suffix` (what the follower's own process wrote,
        `ledger.ids.tagged_event_ids`), at most `limit`; and the position the follower has read
        up to: the last event's when `limit` came back, else the log's head as of the read
        (every event up to it was visible to the read), so that a follower moves past the
        events it skipped instead of reading them again. One round trip when the follower is
        near the head."""
        ...  # fmt: skip

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]: ...

    def read_streams(self, stream_ids: Sequence[str]) -> dict[str, list[Recorded]]: ...

    def read_stream_window(
        self, stream_id: str, after_position: int, before_position: int
    ) -> list[Recorded]: ...

    def streams_with(
        self, event_type: str, occurred_from: datetime, occurred_to: datetime,
        tenant_id: str | None = None,
    ) -> list[str]: ...  # fmt: skip

    def last_position(self) -> int: ...

    def stream_version(self, stream_id: str) -> int: ...

