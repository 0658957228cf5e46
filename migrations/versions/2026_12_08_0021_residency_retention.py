"""Residency and retention (issue 30): `request_log.region` (the replica's region, from
RequestRouted) and `request_log.retention` (the tier the request ran under, from
RequestAdmitted), the finance view `finance_usage_by_region`, and `batch_files.read_once`: a
zero-retention batch's output file is deleted as it is read.

Rows projected before this revision have NULL region and retention: their events carried none
(a rebuild of request_log gives the same NULLs, and "standard" for nothing: an unrecorded tier
is shown as such, not guessed).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _month(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM')"
    return f"strftime('%Y-%m', {column})"


def upgrade() -> None:
    op.add_column("request_log", sa.Column("region", sa.String(32), nullable=True))
    op.add_column("request_log", sa.Column("retention", sa.String(16), nullable=True))
    op.add_column(
        "batch_files",
        sa.Column("read_once", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    # What each region served, per tenant, month and currency: the bill joined with where the
    # request ran ('' for a replica given no region, or a request recorded before regions).
    op.execute(
        f"""
        CREATE VIEW finance_usage_by_region AS
        SELECT l.tenant_id AS tenant, COALESCE(r.region, '') AS region,
               {_month("l.finished_at")} AS period, l.model, l.currency,
               COUNT(*) AS requests, SUM(l.prompt_tokens) AS prompt_tokens,
               SUM(l.completion_tokens) AS completion_tokens,
               SUM(l.cached_tokens) AS cached_tokens, SUM(l.amount_micros) AS amount_micros
        FROM ledger_entries l JOIN request_log r ON r.request_id = l.request_id
        GROUP BY l.tenant_id, COALESCE(r.region, ''), {_month("l.finished_at")}, l.model,
                 l.currency
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW finance_usage_by_region")
    # In place (SQLite 3.35+ drops a column without a copy), as 0018's downgrade.
    op.drop_column("batch_files", "read_once")
    op.drop_column("request_log", "retention")
    op.drop_column("request_log", "region")
