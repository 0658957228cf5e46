"""The consumer port: how a fold receives recorded events, whatever carries them (the SQL log in
embedded mode, a Kafka topic in distributed mode). `EventConsumer`'s docstring is the contract;
tests/contracts/test_consumer.py runs it on both implementations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import sqlalchemy as sa

from tollgate_llm.domain.envelope import Recorded


@dataclass(frozen=True, slots=True)
class Delivery:
    """One record as a consumer received it. `(txid, record.position)` is the store's order
    key: it increases along a partition and names the record whatever offset carried it."""

    record: Recorded
    partition: int
    offset: int
    txid: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.txid, self.record.position)


@dataclass(frozen=True, slots=True)
class Batch:
    """What one `poll` read: the records, and per partition the offset after the last message
    read (dead letters included, so committing the batch moves past them)."""

    deliveries: list[Delivery] = field(default_factory=list)
    next_offsets: dict[int, int] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.deliveries)


class EventConsumer(Protocol):
    """A source of recorded events for one named consumer (a group: every member shares the
    checkpoint).

    Contract (tests/contracts/test_consumer.py):

    - `poll(max_records, timeout_s)` returns the next records after this consumer's checkpoint,
      at most `max_records`, waiting at most `timeout_s` for the first. Within a partition they
      come in the store's order, and every partition holds whole tenants, so one tenant's events
      arrive in the order they were recorded.
    - At-least-once: what was polled but not committed is delivered again to whichever consumer
      of the group next reads that partition (after a crash, a restart or a rebalance).
    - `claim(conn, batch)` runs inside the transaction that applies the batch's effect: it locks
      this group's checkpoint for the batch's partitions and returns the deliveries not applied
      yet (a record can come back after its effect committed: a crash between commit and
      acknowledgement, two members during a rebalance). Apply only those.
    - `commit(conn, batch)` moves the checkpoint past the whole batch inside the same
      transaction: it takes effect only if that transaction commits, so a checkpoint never runs
      ahead of the effect it covers.
    - Records a fold could never apply (malformed, an unknown event type or version) never
      reach `poll`'s answer: they go to a dead letter with the reason and are counted
      (`dead_letters`), and the checkpoint moves past them.
    - `rewind()` goes back to the committed checkpoint (an effect failed and was rolled back:
      its records must be read again). It may fail (it may read the checkpoint from the
      database that just failed); the caller then owes it: nothing polled before it has
      succeeded is applied, and it is tried again before the next poll (`KafkaFoldWorker.
      run_batch`), so the consumer never moves past a record whose effect did not commit.
    - `close()` leaves the group; uncommitted records are delivered again.
    """

    name: str
    dead_letters: int

    def poll(self, max_records: int = 500, timeout_s: float = 0.5) -> Batch: ...

    def claim(self, conn: sa.Connection, batch: Batch) -> list[Delivery]: ...

    def commit(self, conn: sa.Connection, batch: Batch) -> None: ...

    def rewind(self) -> None: ...

    def close(self) -> None: ...
