"""Money with its currency: a `currency` column (ISO 4217) on `ledger_entries` and in the key of
`usage_hourly`, and in every finance view that reads an amount (ledger/FINANCE.md), whose sums
are now per currency.

Every bill recorded before this revision was priced in USD, the only currency there was, so the
existing rows read 'USD' (the server default), as their events do (`UsageBilled.currency`'s
default). `usage_hourly` gains the column in its primary key, so an hour in which the setting
changed keeps one row per currency and never sums two: SQLite cannot change a primary key in
place, so the table is copied into its new shape (both backends, one path). The views read the
tables, so they are dropped first and made again with the column.

The downgrade sums each hour's currencies back into one row: the shape before, which could not
tell them apart.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEWS = ("finance_spend_by_level", "finance_invoices", "finance_invoice_lines",
         "finance_usage_hourly", "finance_ledger_entries", "finance_downgrades",
         "finance_flex_revenue")  # fmt: skip
# PostgreSQL's invoice index (migration 0006) reads a tenant-month from the index alone: it
# carries the currency too, which the invoice now groups by.
INVOICE_INCLUDED = (
    "model", "prompt_micros_per_mtok", "completion_micros_per_mtok", "cached_micros_per_mtok",
    "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros",
)
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")


def _month(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM')"
    return f"strftime('%Y-%m', {column})"


def _day(column: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
    return f"strftime('%Y-%m-%d', {column})"


def _usage_hourly(with_currency: bool) -> None:
    key = ["tenant_id", "model", "hour"] + (["currency"] if with_currency else [])
    op.create_table(
        "usage_hourly",
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        *(
            [sa.Column("currency", sa.String(3), nullable=False, server_default="USD")]
            if with_currency
            else []
        ),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in COUNTS),
        sa.PrimaryKeyConstraint(*key, name="pk_usage_hourly"),
    )


def _views(with_currency: bool) -> None:
    c = "currency, " if with_currency else ""
    op.execute(
        f"""
        CREATE VIEW finance_ledger_entries AS
        SELECT request_id, tenant_id AS tenant, key_id, model,
               prompt_tokens, completion_tokens, cached_tokens,
               prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok,
               amount_micros, {c}terminal AS terminal_reason, admitted_at, finished_at, billed_at
        FROM ledger_entries
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_usage_hourly AS
        SELECT tenant_id AS tenant, model, hour AS period_start, {c}requests,
               prompt_tokens, completion_tokens, cached_tokens, amount_micros
        FROM usage_hourly
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_invoice_lines AS
        SELECT tenant_id AS tenant, {_month("finished_at")} AS period, model, {c}
               prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok,
               COUNT(*) AS requests,
               SUM(prompt_tokens - cached_tokens) AS uncached_prompt_tokens,
               SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens,
               SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        GROUP BY tenant_id, {_month("finished_at")}, model, {c}
                 prompt_micros_per_mtok, completion_micros_per_mtok, cached_micros_per_mtok
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_invoices AS
        SELECT tenant, period, {c}SUM(requests) AS requests,
               SUM(uncached_prompt_tokens) AS uncached_prompt_tokens,
               SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens,
               SUM(amount_micros) AS amount_micros
        FROM finance_invoice_lines
        GROUP BY tenant, period{", currency" if with_currency else ""}
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_spend_by_level AS
        SELECT tenant_id, workspace_id, project_id, {_month("admitted_at")} AS month, {c}
               COUNT(*) AS requests, SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        GROUP BY tenant_id, workspace_id, project_id, {_month("admitted_at")}
                 {", currency" if with_currency else ""}
        """
    )


def _views_beside(with_currency: bool) -> None:
    """The views of migrations 0009 and 0013 that read an amount: with its currency."""
    c = "currency, " if with_currency else ""
    op.execute(
        f"""
        CREATE VIEW finance_downgrades AS
        SELECT l.request_id, l.tenant_id AS tenant, r.requested_model, l.model AS served_model,
               l.amount_micros, {"l.currency, " if with_currency else ""}l.admitted_at,
               l.finished_at
        FROM ledger_entries l JOIN request_log r ON r.request_id = l.request_id
        WHERE r.requested_model IS NOT NULL
        """
    )
    op.execute(
        f"""
        CREATE VIEW finance_flex_revenue AS
        SELECT model, {_day("finished_at")} AS day, {c}COUNT(*) AS requests,
               SUM(prompt_tokens) AS prompt_tokens, SUM(cached_tokens) AS cached_tokens,
               SUM(completion_tokens) AS completion_tokens, SUM(amount_micros) AS amount_micros
        FROM ledger_entries
        WHERE service_tier = 'flex'
        GROUP BY model, {_day("finished_at")}{", currency" if with_currency else ""}
        """
    )


def _copy_usage_hourly(with_currency: bool) -> None:
    counts = ", ".join(COUNTS)
    sums = ", ".join(f"SUM({name})" for name in COUNTS)
    op.execute("CREATE TABLE usage_hourly_copy AS SELECT * FROM usage_hourly")
    op.drop_table("usage_hourly")
    _usage_hourly(with_currency)
    if with_currency:
        op.execute(
            f"INSERT INTO usage_hourly (tenant_id, model, hour, currency, {counts}) "
            f"SELECT tenant_id, model, hour, 'USD', {counts} FROM usage_hourly_copy"
        )
    else:
        op.execute(
            f"INSERT INTO usage_hourly (tenant_id, model, hour, {counts}) "
            f"SELECT tenant_id, model, hour, {sums} FROM usage_hourly_copy "
            "GROUP BY tenant_id, model, hour"
        )
    op.drop_table("usage_hourly_copy")


def _invoice_index(included: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_ledger_entries_invoice", table_name="ledger_entries")
        op.create_index(
            "ix_ledger_entries_invoice", "ledger_entries", ["tenant_id", "finished_at"],
            postgresql_include=list(included),
        )


def upgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.add_column(
        "ledger_entries",
        sa.Column("currency", sa.String(3), nullable=False, server_default="USD"),
    )
    _invoice_index((*INVOICE_INCLUDED, "currency"))
    _copy_usage_hourly(with_currency=True)
    _views(with_currency=True)
    _views_beside(with_currency=True)


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    _copy_usage_hourly(with_currency=False)
    _invoice_index(INVOICE_INCLUDED)
    op.drop_column("ledger_entries", "currency")
    _views(with_currency=False)
    _views_beside(with_currency=False)
