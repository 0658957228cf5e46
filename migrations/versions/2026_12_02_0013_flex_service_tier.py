"""The flex service class: `service_tier` on the request log and the ledger, and the finance
views of flex revenue and preemption waste (ledger/FINANCE.md).

Both columns default to "default" (interactive), which is what every request recorded before
flex existed was; both tables are projections, so `tollgate projections rebuild` gives the same
rows. Preemption waste is what the engine had done for flex requests the router stopped to make
room for interactive ones: never billed to the customer (its ledger entry bills zero tokens), so
it is read from the request log, per model and UTC day.

Revision ID: 0013
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _day(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
    return f"strftime('%Y-%m-%d', {column})"


def upgrade() -> None:
    # Plain ALTER TABLE (SQLite has ADD and, since 3.35, DROP COLUMN): a batch operation would
    # copy the table, which SQLite refuses while the finance views read it.
    for table in ("request_log", "ledger_entries"):
        op.add_column(
            table,
            sa.Column("service_tier", sa.String(16), nullable=False, server_default="default"),
        )
    op.execute(
        f"""
        CREATE VIEW finance_preemption_waste AS
        SELECT model, {_day("finished_at")} AS day, COUNT(*) AS preempted_requests,
               SUM(prompt_tokens) AS prompt_tokens, SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens
        FROM request_log
        WHERE status = 'preempted'
        GROUP BY model, {_day("finished_at")}
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_flex_revenue AS
        SELECT model, {_day("finished_at")} AS day, COUNT(*) AS requests,
               SUM(prompt_tokens) AS prompt_tokens, SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens, SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        WHERE service_tier = 'flex'
        GROUP BY model, {_day("finished_at")}
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW finance_flex_revenue")
    op.execute("DROP VIEW finance_preemption_waste")
    for table in ("ledger_entries", "request_log"):
        op.drop_column(table, "service_tier")
