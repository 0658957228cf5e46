"""Named read positions of consumers that are not table projections (the billing fold)."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ledger.schema import projection_checkpoints as t
from ledger.store import sqlite_instant

# Built once: a statement built per call costs more to construct and cache-key than to run.
_GET = sa.select(t.c.position).where(t.c.name == sa.bindparam("b_name"))
_SET = (
    t.update()
    .where(t.c.name == sa.bindparam("b_name"))
    .values(position=sa.bindparam("b_position"), updated_at=sa.bindparam("b_updated_at"))
)


class Checkpoints:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, name: str) -> int:
        with self.engine.connect() as conn:
            value = conn.execute(_GET, {"b_name": name}).scalar()
        return int(value or 0)

    def set(self, name: str, position: int, conn: sa.Connection | None = None) -> None:
        """Save `position`, in its own transaction or inside the caller's `conn`."""
        if conn is None:
            with self.engine.begin() as own:
                self.set(name, position, own)
            return
        now = datetime.now(UTC)
        if conn.dialect.name == "sqlite" and conn.in_transaction():
            # Inside the fold worker's write transaction, which holds SQLite's only write
            # lock: the driver alone (SQLAlchemy's statement handling is most of the cost).
            cursor = conn.connection.driver_connection.execute(  # type: ignore[union-attr]
                "UPDATE projection_checkpoints SET position = ?, updated_at = ? WHERE name = ?",
                (position, sqlite_instant(now), name),
            )
            if cursor.rowcount:
                return
        updated = conn.execute(
            _SET, {"b_name": name, "b_position": position, "b_updated_at": now}
        ).rowcount
        if not updated:
            conn.execute(t.insert().values(name=name, position=position, updated_at=now))
