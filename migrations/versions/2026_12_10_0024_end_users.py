"""End users (issue 30): `ledger_entries.end_user` and `request_log.end_user`, the keyed hash per
tenant of the caller's own customer (from RequestAdmitted and UsageBilled; never the identifier
itself), and an index for usage grouped by it.

Rows projected before this revision, and every request that named no end user, have NULL: a
rebuild gives the same NULLs (their events carried none).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("end_user", sa.String(32), nullable=True))
    op.add_column("ledger_entries", sa.Column("end_user", sa.String(32), nullable=True))
    op.create_index(
        "ix_ledger_entries_tenant_id_end_user", "ledger_entries", ["tenant_id", "end_user"]
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_tenant_id_end_user", table_name="ledger_entries")
    op.drop_column("ledger_entries", "end_user")
    op.drop_column("request_log", "end_user")
