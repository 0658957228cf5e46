"""dead_letters: the events a fold could not apply and moved past (DESIGN.md invariant 12).

One event that a fold cannot apply must never stop the others: a billing fold or read model
that fails on one event alone, twice, while the database answers, records it here with its
place (the store's position; on Kafka the topic, partition and offset) and the reason, and
moves past it. `tollgate status`, /metrics and /readyz show the unreplayed ones per fold;
`tollgate dead-letters replay` applies them again once fixed (ledger/dead_letters.py).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("fold", sa.String(100), nullable=False),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=True),
        sa.Column("topic", sa.String(249), nullable=True),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("kafka_offset", sa.BigInteger(), nullable=True),
        sa.Column("stream_id", sa.String(255), nullable=False),
        sa.Column("event_type", sa.String(100), nullable=False),
        sa.Column("tenant_id", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("first_failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("fold", "event_id", name="pk_dead_letters"),
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
