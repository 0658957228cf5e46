"""The Batch API's stored content: files (input JSONL, output and error files), the batch
registry, and finished items' responses until their batch's files are written.

These hold prompts and completions, the one deliberate exception to storing no content: each
row has an expiry (domain/batches/: input files 24 h after their batch ends, output and error
files 7 days) after which the batch runner deletes it; DELETE /v1/files/{id} deletes at once.

Revision ID: 0013b
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013b"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("file_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
    )
    op.create_index(
        "ix_batch_files_tenant_id_created_at", "batch_files", ["tenant_id", "created_at"]
    )
    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_table(
        "batch_results",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("custom_id", sa.String(64), primary_key=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("status_code", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("batch_results")
    op.drop_index("ix_batches_tenant_id_created_at", "batches")
    op.drop_table("batches")
    op.drop_index("ix_batch_files_tenant_id_created_at", "batch_files")
    op.drop_table("batch_files")
