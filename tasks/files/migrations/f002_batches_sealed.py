"""batches know their expected count; files record their text encoding

Revision ID: f002
Revises: f001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "f002"
down_revision = "f001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("file_batches") as batch:
        batch.add_column(sa.Column("expected", sa.Integer(), nullable=True))
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("encoding", sa.String(50), nullable=True))
    op.create_index("ix_files_status_updated", "files", ["status", "updated_at"])


def downgrade() -> None:
    op.drop_index("ix_files_status_updated", "files")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("encoding")
    with op.batch_alter_table("file_batches") as batch:
        batch.drop_column("expected")
