"""worker_status: each fold worker's heartbeat, positions and problems, for the edges' /readyz.

Not an event projection: one row per worker, overwritten every pass. The folds run in their own
process (`tollgate worker`), so this row is how an edge learns that billing is alive, how far it
lags and what it could not bill.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_status",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("billing_lag", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("dead_letters", sa.Integer(), nullable=False),
        sa.Column("dead_letter_sample", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_worker_status"),
    )


def downgrade() -> None:
    op.drop_table("worker_status")
