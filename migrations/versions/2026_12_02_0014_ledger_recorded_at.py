"""`ledger_entries.recorded_at`: when the row was written, by the database's clock, so the
billing lag (the terminal event's instant -> its ledger row) is read from what the system
records (bench/pipeline.py) instead of being sampled from outside.

On PostgreSQL it is `clock_timestamp()` at the insert, inside the worker's transaction and a
few milliseconds before its commit (`now()` would be the transaction's start, before the batch
was even claimed); SQLite has one clock per statement. It is not a column of the projection
(`domain.projections.LEDGER_ENTRIES_COLUMNS`): a rebuild writes the same ledger with new write
times, and the digests that prove rebuild == incremental leave it out. Rows written before this
migration get the migration's instant.

Revision ID: 0014
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    now = "clock_timestamp()" if op.get_bind().dialect.name == "postgresql" else "CURRENT_TIMESTAMP"
    op.add_column(
        "ledger_entries",
        sa.Column(
            "recorded_at", sa.DateTime(timezone=True), nullable=False,
            server_default=sa.text(now),
        ),  # fmt: skip
    )


def downgrade() -> None:
    op.drop_column("ledger_entries", "recorded_at")
