"""Alembic migrations: the only way schemas are made; up, down and up again on both backends,
and the result matches the Table objects the code queries."""

from __future__ import annotations

import warnings

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tollgate_llm.ledger import schema
from tollgate_llm.ledger.engine import create_engine_from_url

TABLES = {
    "events",
    "projection_checkpoints",
    "request_log",
    "usage_hourly",
    "ledger_entries",
    "idempotency_records",
    "worker_status",
    "consumer_offsets",
    "batch_files",
    "batches",
    "batch_results",
    "relay_state",
    "dead_letters",
    "reconciliation_status",
}


def tables(url: str) -> set[str]:
    engine = create_engine_from_url(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def differences(url: str) -> list[object]:
    engine = create_engine_from_url(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Did not recognize type 'xid8'")
                diffs = compare_metadata(context, schema.metadata)
    finally:
        engine.dispose()
    # txid exists only on PostgreSQL and is deliberately not in the shared Table object; the
    # invoice covering index (migration 0006) exists only on PostgreSQL, which has INCLUDE; so does
    # the relay's (txid, position) index (migration 0010).
    return [
        d for d in diffs
        if not (d[0] == "remove_column" and d[3].name == "txid")
        and not (
            d[0] in ("remove_index", "add_index")
            and d[1].name in ("ix_ledger_entries_invoice", "ix_events_txid_position")
        )
    ]


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_upgrade_downgrade_upgrade(request: pytest.FixtureRequest, db: str) -> None:
    url = request.getfixturevalue(f"{db}_url")

    assert schema.upgrade(url) == schema.head()
    assert tables(url) == TABLES
    assert differences(url) == []

    schema.downgrade(url, "base")
    assert schema.current(url) is None
    assert tables(url) == set()

    schema.upgrade(url, "0001")
    assert tables(url) == {"events"}
    assert schema.upgrade(url) == schema.head()
    assert tables(url) == TABLES
    assert differences(url) == []


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_bills_before_currencies_read_as_usd_and_survive_the_round_trip(
    request: pytest.FixtureRequest, db: str
) -> None:
    """Migration 0020: a bill posted before it is a USD bill, in its table and every finance view;
    the downgrade gives the rows back in their earlier shape."""
    url = request.getfixturevalue(f"{db}_url")
    schema.upgrade(url, "0019")
    hour = "2026-11-30 10:00:00+00:00"
    engine = create_engine_from_url(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO ledger_entries (request_id, tenant_id, key_id, model, prompt_tokens,"
                " completion_tokens, cached_tokens, prompt_micros_per_mtok,"
                " completion_micros_per_mtok, cached_micros_per_mtok, amount_micros, terminal,"
                " admitted_at, finished_at, billed_at, position, service_tier)"
                " VALUES ('r1', 'acme', 'k1', 'm', 10, 5, 0, 100, 200, 50, 2, 'completed',"
                f" '{hour}', '{hour}', '{hour}', 1, 'default')"
            ))  # fmt: skip
            conn.execute(sa.text(
                "INSERT INTO usage_hourly (tenant_id, model, hour, requests, prompt_tokens,"
                f" completion_tokens, cached_tokens, amount_micros) VALUES ('acme', 'm', '{hour}',"
                " 1, 10, 5, 0, 2)"
            ))  # fmt: skip
        schema.upgrade(url)
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT currency FROM ledger_entries")).scalar() == "USD"
            assert conn.execute(
                sa.text("SELECT currency, amount_micros FROM usage_hourly")
            ).one() == ("USD", 2)
            for view in ("finance_ledger_entries", "finance_usage_hourly",
                         "finance_invoice_lines", "finance_invoices",
                         "finance_spend_by_level"):  # fmt: skip
                assert conn.execute(sa.text(f"SELECT currency FROM {view}")).scalar() == "USD"
            for view in ("finance_downgrades", "finance_flex_revenue"):  # no rows: the column
                assert conn.execute(sa.text(f"SELECT currency FROM {view}")).all() == []
            # Then an hour billed in a second currency keeps a row of its own, and the invoice
            # views total each currency apart.
            conn.execute(sa.text(
                "INSERT INTO usage_hourly (tenant_id, model, hour, currency, requests,"
                " prompt_tokens, completion_tokens, cached_tokens, amount_micros)"
                f" VALUES ('acme', 'm', '{hour}', 'EUR', 1, 1, 1, 0, 3)"
            ))  # fmt: skip
            conn.execute(sa.text(
                "INSERT INTO ledger_entries (request_id, tenant_id, key_id, model, prompt_tokens,"
                " completion_tokens, cached_tokens, prompt_micros_per_mtok,"
                " completion_micros_per_mtok, cached_micros_per_mtok, amount_micros, terminal,"
                " admitted_at, finished_at, billed_at, position, service_tier, currency)"
                " VALUES ('r2', 'acme', 'k1', 'm', 1, 1, 0, 100, 200, 50, 3, 'completed',"
                f" '{hour}', '{hour}', '{hour}', 2, 'default', 'EUR')"
            ))  # fmt: skip
            totals = conn.execute(sa.text(
                "SELECT currency, amount_micros FROM finance_invoices ORDER BY currency"
            )).all()  # fmt: skip
            assert [tuple(t) for t in totals] == [("EUR", 3), ("USD", 2)]
        schema.downgrade(url, "0019")
        assert differences(url) != []  # the earlier shape: no currency column
        with engine.begin() as conn:
            assert conn.execute(
                sa.text("SELECT requests, amount_micros FROM usage_hourly")
            ).one() == (2, 5)
            assert conn.execute(sa.text("SELECT COUNT(*) FROM ledger_entries")).scalar() == 2
        assert schema.upgrade(url) == schema.head()
        assert differences(url) == []
    finally:
        engine.dispose()
