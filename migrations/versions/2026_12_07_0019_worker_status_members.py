"""worker_status: one row per worker process, keyed by (name, member), with the partitions a
Kafka member holds, its last batch and its lag.

The members of a consumer group shared one row (the last writer's), so a dead member did not
show. The table holds heartbeats only, rewritten every second by each live process, so it is
made again rather than altered (SQLite cannot change a primary key in place): the workers
write their rows again within a second of the upgrade.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_table("worker_status")
    op.create_table(
        "worker_status",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("member", sa.String(300), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=True),
        sa.Column("billing_lag", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("dead_letters", sa.Integer(), nullable=False),
        sa.Column("dead_letter_sample", sa.Text(), nullable=True),
        sa.Column("partitions", sa.Text(), nullable=True),
        sa.Column("last_batch_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lag", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("name", "member", name="pk_worker_status"),
    )


def downgrade() -> None:
    op.drop_table("worker_status")
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
