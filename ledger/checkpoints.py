"""Named read positions of consumers that are not table projections (the billing fold)."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ledger.schema import projection_checkpoints as t


class Checkpoints:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, name: str) -> int:
        with self.engine.connect() as conn:
            value = conn.execute(sa.select(t.c.position).where(t.c.name == name)).scalar()
        return int(value or 0)

    def set(self, name: str, position: int) -> None:
        now = datetime.now(UTC)
        with self.engine.begin() as conn:
            updated = conn.execute(
                t.update().where(t.c.name == name).values(position=position, updated_at=now)
            ).rowcount
            if not updated:
                conn.execute(t.insert().values(name=name, position=position, updated_at=now))
