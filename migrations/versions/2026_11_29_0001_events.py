"""events: the append-only log, guarded by triggers on both backends.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PG_GUARD = """
CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = 'events are append-only (' || TG_OP || ' refused)',
        ERRCODE = 'restrict_violation';
END
$$
"""


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "events",
        sa.Column(
            "position",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(),
            nullable=False,
        ),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("stream_id", sa.String(200), nullable=False),
        sa.Column("stream_version", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(100), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("CURRENT_TIMESTAMP"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("position", name="pk_events"),
        sa.UniqueConstraint("event_id", name="uq_events_event_id"),
        sa.UniqueConstraint(
            "stream_id", "stream_version", name="uq_events_stream_id_stream_version"
        ),
    )
    op.create_index("ix_events_tenant_id_position", "events", ["tenant_id", "position"])
    if postgres:
        # The writing transaction's id: readers tail below the oldest running transaction so an
        # event that commits late is never skipped (see SqlEventStore.read_all).
        op.execute("ALTER TABLE events ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id()")
        op.execute(_PG_GUARD)
        op.execute(
            "CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events "
            "FOR EACH ROW EXECUTE FUNCTION events_append_only()"
        )
        op.execute(
            "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
            "FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()"
        )
    else:
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER events_no_{verb.lower()} BEFORE {verb} ON events "
                "BEGIN SELECT RAISE(ABORT, 'events are append-only'); END"
            )


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    # Dropping the table is the one way events leave: it is a schema change, not a code path.
    op.drop_index("ix_events_tenant_id_position", table_name="events")
    op.drop_table("events")  # its triggers go with it
    if postgres:
        op.execute("DROP FUNCTION events_append_only()")
