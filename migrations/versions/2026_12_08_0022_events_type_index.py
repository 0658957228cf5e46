"""An index on the event log by (type, position): a reader that folds one rare event type
(the router's statistics fold FeedbackRecorded at every start, ledger/quality.py) reads those
events only, in order, instead of walking the whole log.

Measured by bench/quality_startup.py (BENCHMARKS.md). On PostgreSQL the index is built inside the
migration's transaction, which holds appends for as long as the build takes (seconds per
million events): run it with the writers stopped, as every migration here.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_events_type_position", "events", ["type", "position"])


def downgrade() -> None:
    op.drop_index("ix_events_type_position", table_name="events")
