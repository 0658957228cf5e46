"""request_log.requested_model: the model a downgraded request asked for (null otherwise), and
the finance view of downgrades (ledger/FINANCE.md).

A request served by another model with its tenant's consent is billed at the model that served
it (`ledger_entries.model`); this column says what it asked for, so finance and support can see
every downgrade. The request log is a projection: `tollgate projections rebuild request_log`
fills the column for requests recorded before it existed.

Revision ID: 0009
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("requested_model", sa.String(200), nullable=True))
    op.execute(
        """
        CREATE VIEW finance_downgrades AS
        SELECT l.request_id, l.tenant_id AS tenant, r.requested_model, l.model AS served_model,
               l.amount_micros, l.admitted_at, l.finished_at
        FROM ledger_entries l JOIN request_log r ON r.request_id = l.request_id
        WHERE r.requested_model IS NOT NULL
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW finance_downgrades")
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("requested_model")
