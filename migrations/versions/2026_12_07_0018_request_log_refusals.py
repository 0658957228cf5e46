"""`request_log.refusals`: a row for the refusals of one key in one window that were counted
rather than recorded one by one (`RefusalsCounted`, domain/refusals.py) says how many; NULL on
every other row (one request).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("request_log", sa.Column("refusals", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Not a batch (copy-and-rename) on SQLite: the finance views read request_log, and SQLite
    # (3.35+) drops a column in place.
    op.drop_column("request_log", "refusals")
