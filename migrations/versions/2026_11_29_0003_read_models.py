"""request_log, usage_hourly, ledger_entries: projections of the log (rebuildable).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _instant(name: str, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _count(name: str, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.BigInteger(), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "request_log",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("key_id", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        _instant("admitted_at"),
        _instant("finished_at", nullable=True),
        _count("prompt_tokens", nullable=True),
        _count("completion_tokens", nullable=True),
        _count("cached_tokens", nullable=True),
        _count("ttft_ms", nullable=True),
        _count("tpot_us", nullable=True),
        sa.Column("finish_reason", sa.String(64), nullable=True),
        sa.Column("replica_id", sa.String(100), nullable=True),
        sa.Column("reject_reason", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name="pk_request_log"),
    )
    op.create_index(
        "ix_request_log_tenant_id_admitted_at", "request_log", ["tenant_id", "admitted_at"]
    )
    op.create_table(
        "usage_hourly",
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        _instant("hour"),
        _count("requests"),
        _count("prompt_tokens"),
        _count("completion_tokens"),
        _count("cached_tokens"),
        _count("amount_micros"),
        sa.PrimaryKeyConstraint("tenant_id", "model", "hour", name="pk_usage_hourly"),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("key_id", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        _count("prompt_tokens"),
        _count("completion_tokens"),
        _count("cached_tokens"),
        _count("prompt_micros_per_mtok"),
        _count("completion_micros_per_mtok"),
        _count("cached_micros_per_mtok"),
        _count("amount_micros"),
        sa.Column("terminal", sa.String(32), nullable=False),
        _instant("admitted_at"),
        _instant("finished_at"),
        _instant("billed_at"),
        _count("position"),
        sa.PrimaryKeyConstraint("request_id", name="pk_ledger_entries"),
    )
    op.create_index(
        "ix_ledger_entries_tenant_id_finished_at", "ledger_entries", ["tenant_id", "finished_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_tenant_id_finished_at", table_name="ledger_entries")
    op.drop_table("ledger_entries")
    op.drop_table("usage_hourly")
    op.drop_index("ix_request_log_tenant_id_admitted_at", table_name="request_log")
    op.drop_table("request_log")
