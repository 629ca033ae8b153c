"""files family tables

Revision ID: f001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp

revision = "f001"
down_revision = None
branch_labels = ("files",)
depends_on = "0001"


def upgrade() -> None:
    op.create_table(
        "file_batches",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("sealed", sa.Boolean(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("terminal", sa.Integer(), nullable=False),
        sa.Column("ready", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("completed_at", Timestamp(), nullable=True),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("batch_id", sa.String(36), nullable=True),
        sa.Column("name", sa.String(500), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("content_ref", sa.String(1000), nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("mime", sa.String(200), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("pages", sa.Integer(), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("chunk_count", sa.Integer(), nullable=True),
        sa.Column("error_type", sa.String(200), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("failed_stage", sa.String(50), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
    )
    op.create_index("ix_files_batch", "files", ["batch_id", "status"])
    op.create_index("ix_files_owner", "files", ["owner"])
    op.create_table(
        "file_chunks",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("file_id", sa.String(36), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("embedding", sa.LargeBinary(), nullable=True),
        sa.Column("model", sa.String(50), nullable=True),
    )
    op.create_index("ix_file_chunks_file", "file_chunks", ["file_id", "ordinal"])
    op.create_index("ix_file_chunks_owner", "file_chunks", ["owner"])


def downgrade() -> None:
    op.drop_table("file_chunks")
    op.drop_table("files")
    op.drop_table("file_batches")
