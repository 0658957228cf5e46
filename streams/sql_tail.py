"""`SqlTail`: the consumer port over the SQL event log (embedded mode, and any fold that needs the
whole log rather than a tenant's partitions). One partition, 0, whose offsets are the store's
positions; the checkpoint is a row of `projection_checkpoints` named after the consumer."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

import sqlalchemy as sa

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.ledger.checkpoints import Checkpoints, read_position, save_position
from tollgate_llm.ledger.schema import projection_checkpoints
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.streams.consumer import Batch, Delivery

_IDLE_POLL_S = 0.05


class SqlTail:
    """Tails `store.read_all` from its checkpoint (see EventConsumer for the contract). SQLite's
    positions are commit order (one writer); on PostgreSQL the store's appends take positions
    in commit order under its table lock, so tailing by position skips nothing. A record the
    store holds is always decodable (it refuses what it cannot read back), so there are no dead
    letters here."""

    dead_letters = 0

    def __init__(
        self, store: EventStore, engine: sa.Engine, name: str, *, event_types: Iterable[str] = ()
    ) -> None:
        self.store = store
        # Only these types are read (empty: all); the rest are skipped by the store's query.
        self.event_types = tuple(sorted(event_types))
        self.engine = engine
        self.name = name
        self.position = Checkpoints(engine).get(name)
        self._polled_from = self.position

    def seek(self, position: int) -> None:
        """Read on from `position` (a fold that keeps its own positions, e.g. the fold worker)."""
        self.position = position

    def poll(self, max_records: int = 500, timeout_s: float = 0.5) -> Batch:
        """The next records after the position. With `event_types`, a poll that reads to the end
        also moves the position past the skipped events before it: to the store's last position
        read before the query (every event at or below it was visible to the query, since
        positions become visible in order), so the position, and the lag read from it, does not
        stay behind at the last event of a followed type."""
        records = self.read(max_records, timeout_s)
        if not records and self.position == self._polled_from:
            return Batch()
        return Batch([Delivery(r, 0, r.position) for r in records], {0: self.position}, {0: 0})

    def read(
        self, max_records: int = 500, timeout_s: float = 0.5,
        known: Mapping[int, Recorded] | None = None,
    ) -> list[Recorded]:  # fmt: skip
        """`poll`'s records without their delivery envelopes, for a fold that keeps its own
        positions and commits nothing through the tail (the fold worker: thousands of records
        a second). `known`: records the caller holds by position (its own appends), which are
        not decoded again (`EventStore.read_all`)."""
        self._polled_from = self.position
        deadline = time.monotonic() + timeout_s
        while True:
            head = self.store.last_position() if self.event_types else 0
            records = self.store.read_all(
                self.position, max_records, event_types=self.event_types, known=known
            )
            if records or time.monotonic() >= deadline:
                break
            if head > self.position:
                break
            time.sleep(_IDLE_POLL_S)
        end = records[-1].position if records else self.position
        if len(records) < max_records:
            end = max(end, head)
        self.position = end
        return records

    def claim(self, conn: sa.Connection, batch: Batch) -> list[Delivery]:
        saved = read_position(conn, self.name, for_update=True)
        if saved is None:
            conn.execute(
                projection_checkpoints.insert().values(
                    name=self.name, position=0, updated_at=datetime.now(UTC)
                )
            )
            saved = 0
        return [d for d in batch.deliveries if d.record.position > saved]

    def commit(self, conn: sa.Connection, batch: Batch) -> None:
        end = batch.next_offsets.get(0)
        if end is None:
            return
        saved = read_position(conn, self.name, for_update=True) or 0
        if end > saved and not save_position(conn, self.name, end):
            Checkpoints(self.engine).set(self.name, end, conn)

    def rewind(self) -> None:
        self.position = Checkpoints(self.engine).get(self.name)

    def close(self) -> None:
        pass
