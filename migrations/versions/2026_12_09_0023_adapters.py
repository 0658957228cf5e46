"""LoRA adapters (issue 30): `request_log.adapter` and `ledger_entries.adapter` (the tenant's
adapter a request was served through, by name, from RequestAdmitted and UsageBilled), the
finance view `finance_usage_by_adapter`, and PostgreSQL's invoice index carrying the adapter,
which the invoice now groups by (its index-only read, migration 0006, stays index-only).

Rows projected before this revision, and every request served by a base model, have NULL: a
rebuild gives the same NULLs (their events carried no adapter).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INVOICE_INCLUDED = (
    "model", "prompt_micros_per_mtok", "completion_micros_per_mtok", "cached_micros_per_mtok",
    "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros", "currency",
)  # fmt: skip


def _month(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM')"
    return f"strftime('%Y-%m', {column})"


def _invoice_index(included: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_ledger_entries_invoice", table_name="ledger_entries")
        op.create_index(
            "ix_ledger_entries_invoice", "ledger_entries", ["tenant_id", "finished_at"],
            postgresql_include=list(included),
        )  # fmt: skip


def upgrade() -> None:
    op.add_column("request_log", sa.Column("adapter", sa.String(64), nullable=True))
    op.add_column("ledger_entries", sa.Column("adapter", sa.String(64), nullable=True))
    _invoice_index((*INVOICE_INCLUDED, "adapter"))
    # What each adapter was billed, per tenant, month, base model and currency ('' for the
    # base model itself).
    op.execute(
        f"""
        CREATE VIEW finance_usage_by_adapter AS
        SELECT tenant_id AS tenant, COALESCE(adapter, '') AS adapter,
               {_month("finished_at")} AS period, model, currency,
               COUNT(*) AS requests, SUM(prompt_tokens) AS prompt_tokens,
               SUM(completion_tokens) AS completion_tokens,
               SUM(cached_tokens) AS cached_tokens, SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        GROUP BY tenant_id, COALESCE(adapter, ''), {_month("finished_at")}, model, currency
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW finance_usage_by_adapter")
    _invoice_index(INVOICE_INCLUDED)
    op.drop_column("ledger_entries", "adapter")
    op.drop_column("request_log", "adapter")
