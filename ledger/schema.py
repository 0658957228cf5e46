"""The tables of Tollgate as SQLAlchemy Core `Table`s, and the programmatic way to migrate them.

Migrations (Alembic, `migrations/`) are the only thing that creates these tables; the objects
here describe them for queries. `tests/integration/test_migrations.py` checks the two agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

# Explicit, predictable constraint names so migrations can drop and alter them on both backends.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware instant that always comes back as UTC.

    SQLite has no timestamptz: it stores text without an offset and returns naive datetimes, so
    we store UTC and re-attach UTC on the way out. PostgreSQL returns the session's zone, which we
    normalise so equal instants compare and hash the same everywhere.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: Tollgate stores timezone-aware UTC only")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # CURRENT_TIMESTAMP defaults read back raw on some paths
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# SQLite only makes a column an alias of the rowid (and so auto-assigned) when it is INTEGER.
PositionType = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# The event log. Append-only: triggers in the migration refuse UPDATE, DELETE and TRUNCATE.
# PostgreSQL also has `txid xid8 DEFAULT pg_current_xact_id()`; it is left out of this object
# because SQLite has no such column and the store names it explicitly where it reads it.
events = sa.Table(
    "events",
    metadata,
    sa.Column("position", PositionType, sa.Identity(), primary_key=True),
    sa.Column("event_id", sa.String(36), nullable=False, unique=True),
    sa.Column("stream_id", sa.String(200), nullable=False),
    sa.Column("stream_version", sa.Integer, nullable=False),
    sa.Column("type", sa.String(100), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("tenant_id", sa.String(100), nullable=False),
    sa.Column("occurred_at", UTCDateTime, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column(
        "recorded_at", UTCDateTime, nullable=False, server_default=sa.text("CURRENT_TIMESTAMP")
    ),
    sa.UniqueConstraint("stream_id", "stream_version"),
    sa.Index(None, "tenant_id", "position"),
    # A fold of one event type reads its events only (migration 0022).
    sa.Index(None, "type", "position"),
)

projection_checkpoints = sa.Table(
    "projection_checkpoints",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

request_log = sa.Table(
    "request_log",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(100), nullable=False),
    sa.Column("key_id", sa.String(100), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("tier", sa.String(32), nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("admitted_at", UTCDateTime, nullable=False),
    sa.Column("finished_at", UTCDateTime),
    sa.Column("prompt_tokens", sa.BigInteger),
    sa.Column("completion_tokens", sa.BigInteger),
    sa.Column("cached_tokens", sa.BigInteger),
    sa.Column("ttft_ms", sa.BigInteger),
    sa.Column("tpot_us", sa.BigInteger),
    sa.Column("finish_reason", sa.String(64)),
    sa.Column("replica_id", sa.String(100)),
    sa.Column("reject_reason", sa.String(64)),
    sa.Column("requested_model", sa.String(200)),  # when another model served it, by consent
    sa.Column("service_tier", sa.String(16), nullable=False, server_default="default"),
    sa.Column("refusals", sa.BigInteger),  # a row of counted refusals: how many (domain.refusals)
    sa.Column("region", sa.String(32)),  # the replica's region (RequestRouted), migration 0021
    sa.Column("retention", sa.String(16)),  # the tier it ran under (RequestAdmitted)
    sa.Column("adapter", sa.String(64)),  # its tenant's LoRA adapter, by name (migration 0023)
    sa.Column("end_user", sa.String(32)),  # the end user's keyed hash (migration 0024)
    sa.Index(None, "tenant_id", "admitted_at"),
)

usage_hourly = sa.Table(
    "usage_hourly",
    metadata,
    sa.Column("tenant_id", sa.String(100), primary_key=True),
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("hour", UTCDateTime, primary_key=True),
    # ISO 4217 (migration 0020): an hour in which the currency setting changed has a row per
    # currency, never one sum of two.
    sa.Column("currency", sa.String(3), primary_key=True, server_default="USD"),
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
)

ledger_entries = sa.Table(
    "ledger_entries",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(100), nullable=False),
    sa.Column("key_id", sa.String(100), nullable=False),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False),
    sa.Column("prompt_micros_per_mtok", sa.BigInteger, nullable=False),
    sa.Column("completion_micros_per_mtok", sa.BigInteger, nullable=False),
    sa.Column("cached_micros_per_mtok", sa.BigInteger, nullable=False),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
    sa.Column("terminal", sa.String(32), nullable=False),
    sa.Column("admitted_at", UTCDateTime, nullable=False),
    sa.Column("finished_at", UTCDateTime, nullable=False),
    sa.Column("billed_at", UTCDateTime, nullable=False),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("service_tier", sa.String(16), nullable=False, server_default="default"),
    sa.Column("workspace_id", sa.String(64)),
    sa.Column("project_id", sa.String(64)),
    sa.Column("run_id", sa.String(128)),
    # ISO 4217 of the entry's prices and amount (migration 0020; 'USD' for every earlier bill).
    sa.Column("currency", sa.String(3), nullable=False, server_default="USD"),
    sa.Column("adapter", sa.String(64)),  # the LoRA adapter it was served through (0023)
    sa.Column("end_user", sa.String(32)),  # the end user's keyed hash, never in clear (0024)
    # When the row was written (the database's clock; migration 0014): the billing lag's end.
    # Not a projection column, so rebuilds and digests ignore it.
    sa.Column(
        "recorded_at", UTCDateTime, nullable=False, server_default=sa.text("CURRENT_TIMESTAMP")
    ),
    sa.Index(None, "tenant_id", "finished_at"),
    sa.Index("ix_ledger_entries_tenant_id_project_id", "tenant_id", "project_id"),
    sa.Index("ix_ledger_entries_tenant_id_end_user", "tenant_id", "end_user"),
    # PostgreSQL only (migration 0006): an invoice reads a tenant-month from the index alone.
    sa.Index(
        "ix_ledger_entries_invoice", "tenant_id", "finished_at",
        postgresql_include=["model", "prompt_micros_per_mtok", "completion_micros_per_mtok",
                            "cached_micros_per_mtok", "prompt_tokens", "completion_tokens",
                            "cached_tokens", "amount_micros", "currency", "adapter"],
    ),
)

# Not an event projection: one row per worker process (a fold worker, a member of the folds'
# consumer group, the batch runner), overwritten every second or so (heartbeat, how far billing
# lags, what it could not bill), deleted by a clean stop. The edges read it for /readyz,
# /metrics and whether a batch runner runs; `tollgate status` lists it.
worker_status = sa.Table(
    "worker_status",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    # One row per process (migration 0019): "host:pid", so each member of a consumer group, and
    # a dead one, shows.
    sa.Column("member", sa.String(300), primary_key=True),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("heartbeat_at", UTCDateTime, nullable=False),
    # The store position it follows; NULL for a process that follows none (a Kafka member that
    # does not lead the sweeper, the batch runner).
    sa.Column("position", sa.BigInteger),
    sa.Column("billing_lag", sa.BigInteger, nullable=False),
    sa.Column("error", sa.Text),
    sa.Column("dead_letters", sa.Integer, nullable=False),
    sa.Column("dead_letter_sample", sa.Text),
    sa.Column("partitions", sa.Text),  # a Kafka member's assignment, e.g. "0,1,2"
    sa.Column("last_batch_at", UTCDateTime),  # the last batch that brought records
    sa.Column("lag", sa.BigInteger),  # messages behind on its partitions, where it knows
)

# Not an event projection: the events a fold could not apply and moved past (migration 0017,
# ledger/dead_letters.py), one row per (fold, event id), replayed in place.
dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("fold", sa.String(100), primary_key=True),
    sa.Column("event_id", sa.String(64), primary_key=True),
    sa.Column("position", sa.BigInteger),
    sa.Column("topic", sa.String(249)),
    sa.Column("kafka_partition", sa.Integer),
    sa.Column("kafka_offset", sa.BigInteger),
    sa.Column("stream_id", sa.String(255), nullable=False),
    sa.Column("event_type", sa.String(100), nullable=False),
    sa.Column("tenant_id", sa.String(255), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("failures", sa.Integer, nullable=False),
    sa.Column("first_failed_at", UTCDateTime, nullable=False),
    sa.Column("last_failed_at", UTCDateTime, nullable=False),
    sa.Column("replayed_at", UTCDateTime),
)

# The continuous reconciliation's last result (streams/reconciler.py), one row per reconciler
# (one leads per database): what `tollgate status`, /readyz and /metrics alarm on.
reconciliation_status = sa.Table(
    "reconciliation_status",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("checked_at", UTCDateTime, nullable=False),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("unbilled_terminals", sa.BigInteger, nullable=False),
    sa.Column("oldest_unbilled_at", UTCDateTime),
    sa.Column("overdue_leases", sa.BigInteger, nullable=False),
    sa.Column("oldest_overdue_at", UTCDateTime),
    sa.Column("sample", sa.Text),
)

# Not event projections: where the distributed mode's Kafka consumers and the outbox relay keep
# their places (migration 0010 says why they live in the database).
consumer_offsets = sa.Table(
    "consumer_offsets",
    metadata,
    sa.Column("consumer_group", sa.String(200), primary_key=True),
    sa.Column("topic", sa.String(249), primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("next_offset", sa.BigInteger, nullable=False),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("last_txid", sa.BigInteger, nullable=False),
    sa.Column("last_position", sa.BigInteger, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

relay_state = sa.Table(
    "relay_state",
    metadata,
    sa.Column("topic", sa.String(249), primary_key=True),
    sa.Column("epoch", sa.Integer, nullable=False),
    sa.Column("last_txid", sa.BigInteger, nullable=False),
    sa.Column("last_position", sa.BigInteger, nullable=False),
    sa.Column("published", sa.BigInteger, nullable=False),
    sa.Column("partition_ends", sa.Text, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

# Not an event projection: a mutable 24 h cache of responses the client explicitly asked to be
# replayable (Idempotency-Key). Rows are written, finished and expired in place; the billing
# truth stays in `events`, so dropping this table loses replays, never money.
idempotency_records = sa.Table(
    "idempotency_records",
    metadata,
    sa.Column("tenant_id", sa.String(100), primary_key=True),
    sa.Column("idempotency_key", sa.String(255), primary_key=True),
    sa.Column("request_id", sa.String(64), nullable=False),
    sa.Column("body_sha256", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("response_status", sa.Integer),
    sa.Column("response_body", sa.Text),
    sa.Column("content_type", sa.String(100)),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
    sa.CheckConstraint("status IN ('in_flight', 'done')", name="status"),
)


# The Batch API's stored content (migration 0013b; ledger/batches.py). Not event projections:
# the one place prompts (input files) and completions (results, output files) are kept, each
# with an expiry after which it is deleted (domain/batches/ states the retention).
batch_files = sa.Table(
    "batch_files",
    metadata,
    sa.Column("file_id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(100), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("filename", sa.String(255), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("expires_at", UTCDateTime, nullable=False),
    sa.Column("content", sa.LargeBinary, nullable=False),
    # Zero retention: deleted as it is read (an output file is streamed once).
    sa.Column("read_once", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Index(None, "tenant_id", "created_at"),
)

# Which batches exist, for listing a tenant's and for the runner to find the open ones (the
# batch itself is its event stream).
batches = sa.Table(
    "batches",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("tenant_id", sa.String(100), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("ended_at", UTCDateTime),
    sa.Index(None, "tenant_id", "created_at"),
)

# One finished item's response until its batch's output and error files are written.
batch_results = sa.Table(
    "batch_results",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("custom_id", sa.String(64), primary_key=True),
    sa.Column("request_id", sa.String(64), nullable=False),
    sa.Column("status_code", sa.Integer, nullable=False),
    sa.Column("body", sa.LargeBinary, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
)


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    here = Path(str(resources.files("tollgate_llm.migrations")))
    config = Config(str(here / "alembic.ini"))
    config.set_main_option("script_location", str(here))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> str | None:
    """Migrate the database at `url` up to `revision` (used by `tollgate db upgrade`); returns
    the revision the database is then at."""
    from alembic import command

    command.upgrade(_alembic_config(url), revision)
    return current(url)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at `url` down to `revision` ("base" removes every table)."""
    from alembic import command

    command.downgrade(_alembic_config(url), revision)


def head() -> str:
    """The newest revision the migrations know."""
    from alembic.script import ScriptDirectory

    revision = ScriptDirectory.from_config(_alembic_config("")).get_current_head()
    assert revision is not None
    return revision


def current(url: str) -> str | None:
    """The revision the database is at, or None for an empty database."""
    from alembic.runtime.migration import MigrationContext

    from tollgate_llm.ledger.engine import create_engine_from_url

    engine = create_engine_from_url(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
