"""Named read positions in `projection_checkpoints`: the projections' (ledger/projections.py)
and those of consumers that are not table projections (the billing fold).

`read_position` and `save_position` work inside a caller's connection. In a SQLite write
transaction (the fold worker's, which holds the database's only write lock, the one admissions
wait for) they run on the driver alone: SQLAlchemy's statement handling was most of their cost.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.schema import projection_checkpoints as t
from tollgate_llm.ledger.store import sqlite_instant

# Built once: a statement built per call costs more to construct and cache-key than to run.
_GET = sa.select(t.c.position).where(t.c.name == sa.bindparam("b_name"))
_GET_FOR_UPDATE = _GET.with_for_update()
_SET = (
    t.update()
    .where(t.c.name == sa.bindparam("b_name"))
    .values(position=sa.bindparam("b_position"), updated_at=sa.bindparam("b_updated_at"))
)
_SQLITE_GET = "SELECT position FROM projection_checkpoints WHERE name = ?"
_SQLITE_SET = "UPDATE projection_checkpoints SET position = ?, updated_at = ? WHERE name = ?"


def _sqlite_in_transaction(conn: sa.Connection) -> bool:
    return conn.dialect.name == "sqlite" and conn.in_transaction()


def read_position(conn: sa.Connection, name: str, *, for_update: bool = False) -> int | None:
    """The saved position of `name`, None if it has none; `for_update` locks the row
    (PostgreSQL; on SQLite the write transaction already holds the lock)."""
    if _sqlite_in_transaction(conn):
        row = conn.connection.driver_connection.execute(_SQLITE_GET, (name,)).fetchone()  # type: ignore[union-attr]
        return None if row is None else int(row[0])
    query = _GET_FOR_UPDATE if for_update and conn.dialect.name == "postgresql" else _GET
    value = conn.execute(query, {"b_name": name}).scalar()
    return None if value is None else int(value)


def save_position(conn: sa.Connection, name: str, position: int) -> bool:
    """Move an existing checkpoint to `position`; False if `name` has no row yet."""
    now = datetime.now(UTC)
    if _sqlite_in_transaction(conn):
        cursor = conn.connection.driver_connection.execute(  # type: ignore[union-attr]
            _SQLITE_SET, (position, sqlite_instant(now), name)
        )
        return bool(cursor.rowcount)
    params = {"b_name": name, "b_position": position, "b_updated_at": now}
    return bool(conn.execute(_SET, params).rowcount)


class Checkpoints:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, name: str) -> int:
        return self.find(name) or 0

    def find(self, name: str) -> int | None:
        """The saved position of `name`, None if it was never saved."""
        with self.engine.connect() as conn:
            return read_position(conn, name)

    @faults.seam("db.checkpoint")
    def set(self, name: str, position: int, conn: sa.Connection | None = None) -> None:
        """Save `position`, in its own transaction or inside the caller's `conn`."""
        if conn is None:
            with self.engine.begin() as own:
                self.set(name, position, own)
            return
        if not save_position(conn, name, position):
            now = datetime.now(UTC)
            conn.execute(t.insert().values(name=name, position=position, updated_at=now))
