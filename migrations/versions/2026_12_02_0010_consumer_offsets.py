"""consumer_offsets and relay_state: where the distributed mode's Kafka consumers and the outbox
relay keep their places, in the database their effects are written to.

A Kafka consumer's offsets live here, not in Kafka, so they commit in the same transaction as
the rows they cover (no Kafka transactions needed). Each row also keeps the store's order key
(`last_txid`, `last_position`) of the last record applied from its partition: a topic that was
re-published after a broker loss has new offsets, and the key is what tells an old record from
a new one. The relay keeps its own place (the last transaction id and position it published) and
its epoch, which grows each time it re-publishes from the store. On PostgreSQL the relay tails
`events` by `(txid, position)`, hence the index.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "consumer_offsets",
        sa.Column("consumer_group", sa.String(200), nullable=False),
        sa.Column("topic", sa.String(249), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("last_txid", sa.BigInteger(), nullable=False),
        sa.Column("last_position", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "consumer_group", "topic", "partition", name="pk_consumer_offsets"
        ),
    )
    op.create_table(
        "relay_state",
        sa.Column("topic", sa.String(249), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("last_txid", sa.BigInteger(), nullable=False),
        sa.Column("last_position", sa.BigInteger(), nullable=False),
        sa.Column("published", sa.BigInteger(), nullable=False),
        # JSON: partition -> offset after the last message the broker acknowledged, this epoch.
        sa.Column("partition_ends", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("topic", name="pk_relay_state"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_events_txid_position", "events", ["txid", "position"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_events_txid_position", table_name="events")
    op.drop_table("relay_state")
    op.drop_table("consumer_offsets")
