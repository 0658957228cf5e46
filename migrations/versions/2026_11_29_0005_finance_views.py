"""finance views: the documented, stable SQL interface finance queries (ledger/FINANCE.md).

The tables behind them are projections that may change shape; these views keep their column
names. Money is integer micro-units; a period is a calendar month in UTC.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEWS = ("finance_invoices", "finance_invoice_lines", "finance_usage_hourly",
         "finance_ledger_entries")


def _month(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM')"
    return f"strftime('%Y-%m', {column})"


def upgrade() -> None:
    op.execute(
        """
        CREATE VIEW finance_ledger_entries AS
        SELECT request_id, tenant_id AS tenant, key_id, model,
               prompt_tokens, completion_tokens, cached_tokens,
               prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok,
               amount_micros, terminal AS terminal_reason, admitted_at, finished_at, billed_at
        FROM ledger_entries
        """
    )
    op.execute(
        """
        CREATE VIEW finance_usage_hourly AS
        SELECT tenant_id AS tenant, model, hour AS period_start, requests,
               prompt_tokens, completion_tokens, cached_tokens, amount_micros
        FROM usage_hourly
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_invoice_lines AS
        SELECT tenant_id AS tenant, {_month("finished_at")} AS period, model,
               prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok,
               COUNT(*) AS requests,
               SUM(prompt_tokens - cached_tokens) AS uncached_prompt_tokens,
               SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens,
               SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        GROUP BY tenant_id, {_month("finished_at")}, model,
                 prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok
        """
    )
    op.execute(
        """
        CREATE VIEW finance_invoices AS
        SELECT tenant, period, SUM(requests) AS requests,
               SUM(uncached_prompt_tokens) AS uncached_prompt_tokens,
               SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens,
               SUM(amount_micros) AS amount_micros
        FROM finance_invoice_lines
        GROUP BY tenant, period
        """
    )


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
