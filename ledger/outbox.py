"""The store side of the outbox relay: committed events in transaction order, and the relay's
own place (`relay_state`). PostgreSQL only (the distributed mode's store).

`read_committed` tails `events` by `(txid, position)` below the snapshot's xmin: a sequence
hands out positions in the order transactions *start*, not the order they commit, so a reader
that keeps the highest position it has seen skips forever an event whose transaction commits
late. Every transaction with an id below xmin has ended, so nothing can still appear below the
key the relay has reached (eugene-khyst/postgresql-event-sourcing's rule). The price: xmin is
cluster-wide, so a long transaction anywhere on the server holds the relay back (relay lag
shows it) — it delays, it never loses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.schema import relay_state as t

_READ = sa.text(
    "SELECT txid::text::bigint AS txid, position, event_id, stream_id, stream_version, "
    "tenant_id, occurred_at, type, version, payload FROM events "
    "WHERE (txid, position) > (CAST(CAST(:txid AS text) AS xid8), :position) "
    "AND txid < pg_snapshot_xmin(pg_current_snapshot()) "
    # By the columns, not the output's bigint `txid`: that alias would sort every row after the
    # key instead of reading the index in order up to the limit.
    "ORDER BY events.txid, events.position LIMIT :limit"
)
_BACKLOG = sa.text(
    "SELECT count(*) FROM events WHERE (txid, position) > "
    "(CAST(CAST(:txid AS text) AS xid8), :position)"
)


class OutboxRow(NamedTuple):
    """A committed event as stored (payload still JSON text: the relay forwards it as is). A
    named tuple read straight from the driver: the relay reads thousands a second, and a
    dataclass built from SQLAlchemy's rows was a fifth of its CPU."""

    txid: int
    position: int
    event_id: str
    stream_id: str
    stream_version: int
    tenant_id: str
    occurred_at: datetime
    type: str
    version: int
    payload: str


@dataclass(slots=True)
class RelayState:
    """Where the relay is: the key of the last event the broker acknowledged, how many it
    published this epoch, and per partition a mark the partition's high watermark must reach
    (the first offset acknowledged in the latest step that wrote to it, plus one; lower means
    the broker lost it — streams/relay.py says why not the last offset)."""

    topic: str
    epoch: int = 1
    last_txid: int = 0
    last_position: int = 0
    published: int = 0
    partition_ends: dict[int, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return (self.last_txid, self.last_position)


class OutboxReader:
    def __init__(self, engine: sa.Engine) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError("the outbox relay needs the PostgreSQL event store")
        self.engine = engine

    @faults.seam("store.read")
    def read_committed(self, after: tuple[int, int], limit: int = 2000) -> list[OutboxRow]:
        """Events after the key `after` whose transactions have ended, in `(txid, position)`
        order: what a relay can publish now without ever skipping a late commit."""
        with self.engine.connect() as conn:
            # Through SQLAlchemy, not the raw driver: a connection the network broke is
            # invalidated, and its error is a DBAPIError, which the relay's loop retries.
            params = {"txid": after[0], "position": after[1], "limit": limit}
            rows = conn.execute(_READ, params).all()
        make = OutboxRow._make
        return [make(r) for r in rows]

    def backlog(self, after: tuple[int, int]) -> int:
        """How many stored events lie after `after` (committed or not yet visible)."""
        with self.engine.connect() as conn:
            return backlog_after(conn, after)

    def load_state(self, topic: str) -> RelayState:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(t).where(t.c.topic == topic)).mappings().first()
        if row is None:
            return RelayState(topic)
        ends = {int(k): int(v) for k, v in orjson.loads(row["partition_ends"]).items()}
        return RelayState(
            topic, row["epoch"], row["last_txid"], row["last_position"], row["published"], ends
        )

    @faults.seam("db.offsets")
    def save_state(self, state: RelayState) -> None:
        values = {
            "topic": state.topic, "epoch": state.epoch, "last_txid": state.last_txid,
            "last_position": state.last_position, "published": state.published,
            "partition_ends": orjson.dumps({str(k): v for k, v in state.partition_ends.items()})
            .decode(),
            "updated_at": datetime.now(UTC),
        }  # fmt: skip
        with self.engine.begin() as conn:
            conn.execute(_SAVE, values)


def _save_statement() -> sa.Insert:
    """The relay's state upsert, built once (constructing it per step cost more than running
    it)."""
    columns = ("epoch", "last_txid", "last_position", "published", "partition_ends", "updated_at")
    insert = pg_insert(t).values({c: sa.bindparam(c) for c in ("topic", *columns)})
    return insert.on_conflict_do_update(
        index_elements=[t.c.topic], set_={c: insert.excluded[c] for c in columns}
    )


_SAVE = _save_statement()


def backlog_after(conn: sa.Connection, after: tuple[int, int]) -> int:
    """How many stored events lie after the relay key `after`: the relay lag, in events."""
    return int(conn.execute(_BACKLOG, {"txid": after[0], "position": after[1]}).scalar() or 0)


def current_epoch(engine: sa.Engine, topic: str) -> int:
    """The relay's epoch for `topic` (0 before it first ran): consumers compare it with the
    epoch of their saved offsets."""
    with engine.connect() as conn:
        value = conn.execute(sa.select(t.c.epoch).where(t.c.topic == topic)).scalar()
    return int(value or 0)
