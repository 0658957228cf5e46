"""Alembic migrations: the only way schemas are made; up, down and up again on both backends,
and the result matches the Table objects the code queries."""

from __future__ import annotations

import warnings

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from ledger import schema
from ledger.engine import create_engine_from_url

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
