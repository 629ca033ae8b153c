"""the staging keys of chunk writers (a chunk attempt, a re-embed), so that what a dead one staged is swept

Revision ID: f005
Revises: f004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "f005"
down_revision = "f004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = own_table("file_chunk_staging")
    op.create_table(
        table,
        sa.Column("key", sa.String(length=36), nullable=False),
        sa.Column("file_id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_file_chunk_staging"),
    )
    op.create_index("ix_file_chunk_staging_job", table, ["job_id"])


def downgrade() -> None:
    table = own_table("file_chunk_staging")
    op.drop_index("ix_file_chunk_staging_job", table_name=table)
    op.drop_table(table)
