"""Consumer offsets in `consumer_offsets`: a Kafka consumer's place per partition, saved in the
transaction of the effect it covers (streams/kafka_consumer.py).

Each row holds the next offset to read, the relay epoch that offset belongs to, and the store's
order key `(txid, position)` of the last record applied. The key is what makes an effect
exactly-once: `claim` locks the partitions' rows and answers the key they are at, and a record
at or below it is not applied again, whether it comes back because a worker died before its
commit, because two workers briefly held one partition during a rebalance, or because the relay
re-published the topic after a broker loss (new offsets, same keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.schema import consumer_offsets as t


@dataclass(frozen=True, slots=True)
class PartitionPlace:
    next_offset: int
    epoch: int
    last_txid: int
    last_position: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.last_txid, self.last_position)


def read_places(
    engine: sa.Engine, group: str, topic: str, partitions: Iterable[int]
) -> dict[int, PartitionPlace]:
    """The saved places of `partitions` (absent: never committed)."""
    wanted = list(partitions)
    if not wanted:
        return {}
    with engine.connect() as conn:
        return _places(conn, group, topic, wanted, lock=False)


def claim_places(
    conn: sa.Connection, group: str, topic: str, partitions: Iterable[int]
) -> dict[int, PartitionPlace]:
    """Inside the effect's transaction: lock the partitions' rows (creating missing ones) and
    answer where they are. A second worker claiming the same partition waits here until the
    first commits, then sees what it applied."""
    wanted = sorted(set(partitions))
    if not wanted:
        return {}
    now = datetime.now(UTC)
    fresh = [
        {"consumer_group": group, "topic": topic, "partition": p, "next_offset": 0, "epoch": 0,
         "last_txid": 0, "last_position": 0, "updated_at": now}
        for p in wanted
    ]
    if conn.dialect.name == "postgresql":
        conn.execute(pg_insert(t).on_conflict_do_nothing(), fresh)
    else:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        conn.execute(sqlite_insert(t).on_conflict_do_nothing(), fresh)
    return _places(conn, group, topic, wanted, lock=True)


@faults.seam("db.offsets")
def save_places(
    conn: sa.Connection, group: str, topic: str, places: Mapping[int, PartitionPlace]
) -> None:
    """Inside the effect's transaction, after `claim_places`: move the partitions' rows."""
    now = datetime.now(UTC)
    for partition, place in places.items():
        conn.execute(
            t.update()
            .where(t.c.consumer_group == group, t.c.topic == topic, t.c.partition == partition)
            .values(
                next_offset=place.next_offset, epoch=place.epoch, last_txid=place.last_txid,
                last_position=place.last_position, updated_at=now,
            )
        )


def _places(
    conn: sa.Connection, group: str, topic: str, partitions: list[int], *, lock: bool
) -> dict[int, PartitionPlace]:
    query = sa.select(
        t.c.partition, t.c.next_offset, t.c.epoch, t.c.last_txid, t.c.last_position
    ).where(t.c.consumer_group == group, t.c.topic == topic, t.c.partition.in_(partitions))
    if lock and conn.dialect.name == "postgresql":
        query = query.order_by(t.c.partition).with_for_update()
    return {
        r.partition: PartitionPlace(r.next_offset, r.epoch, r.last_txid, r.last_position)
        for r in conn.execute(query)
    }
