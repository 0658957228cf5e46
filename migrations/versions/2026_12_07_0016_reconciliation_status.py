"""`reconciliation_status`: the continuous reconciliation's last result (streams/reconciler.py):
terminal events without their ledger row and admitted requests past their lease, each with the
instant of its oldest, so that an alarm is an age read at any time, not a value written once.

Revision ID: 0016
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "reconciliation_status",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("unbilled_terminals", sa.BigInteger(), nullable=False),
        sa.Column("oldest_unbilled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("overdue_leases", sa.BigInteger(), nullable=False),
        sa.Column("oldest_overdue_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sample", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_reconciliation_status"),
    )


def downgrade() -> None:
    op.drop_table("reconciliation_status")
