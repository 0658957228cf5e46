"""The hierarchy on the ledger: `workspace_id`, `project_id` and `run_id` on `ledger_entries`
(from each bill, which carries its request's place in its tenant's tree and its agent run), and
the `finance_spend_by_level` view of spend per tenant, workspace, project and UTC month
(ledger/FINANCE.md).

Null is a key of the organization itself (no workspace or project) or a call outside a run,
which is what every request billed before the hierarchy existed was; the table is a projection,
so `tollgate projections rebuild ledger_entries` gives the same rows.

Revision ID: 0011
Revises: 0013b
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0013b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _month(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM')"
    return f"strftime('%Y-%m', {column})"


def upgrade() -> None:
    # Plain ALTER TABLE, as migration 0013 does: a batch operation would copy the table, which
    # SQLite refuses while the finance views read it.
    op.add_column("ledger_entries", sa.Column("workspace_id", sa.String(64), nullable=True))
    op.add_column("ledger_entries", sa.Column("project_id", sa.String(64), nullable=True))
    op.add_column("ledger_entries", sa.Column("run_id", sa.String(128), nullable=True))
    op.create_index(
        "ix_ledger_entries_tenant_id_project_id", "ledger_entries", ["tenant_id", "project_id"]
    )
    op.execute(
        f"""
        CREATE VIEW finance_spend_by_level AS
        SELECT tenant_id, workspace_id, project_id, {_month("admitted_at")} AS month,
               COUNT(*) AS requests, SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        GROUP BY tenant_id, workspace_id, project_id, {_month("admitted_at")}
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW finance_spend_by_level")
    op.drop_index("ix_ledger_entries_tenant_id_project_id", table_name="ledger_entries")
    for column in ("run_id", "project_id", "workspace_id"):
        op.drop_column("ledger_entries", column)
