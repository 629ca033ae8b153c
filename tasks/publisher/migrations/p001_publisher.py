"""publisher family table: publisher_jobs, the record of each scheduled post

Revision ID: p001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "p001"
down_revision = None
branch_labels = ("publisher",)
# Conveyor's own schema (0011), not its newest revision: a revision a family depends on
# leaves the version table, and another deployment on the same database (one without this
# family) must still find the platform's head there.
depends_on = "0011"


def upgrade() -> None:
    table = own_table("publisher_jobs")
    op.create_table(
        table,
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("type", sa.String(20), nullable=False),
        sa.Column("parent_id", sa.String(36), nullable=True),
        sa.Column("owner", sa.String(100), nullable=True),
        sa.Column("brand", sa.String(100), nullable=False),
        sa.Column("channel", sa.String(20), nullable=False),
        sa.Column("account", sa.String(100), nullable=False),
        sa.Column("caption", sa.Text(), nullable=False),
        sa.Column("media", sa.JSON(), nullable=False),
        sa.Column("first_comment", sa.Text(), nullable=True),
        sa.Column("scheduled_at", Timestamp(), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=False),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=True),
        sa.Column("container_id", sa.String(100), nullable=True),
        sa.Column("container_at", Timestamp(), nullable=True),
        sa.Column("sending_at", Timestamp(), nullable=True),
        sa.Column("remote_id", sa.String(100), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
        sa.Column("completed_at", Timestamp(), nullable=True),
    )
    # A cancelled post leaves its plan free to be scheduled again.
    op.create_index(
        "uq_publisher_jobs_channel_key",
        table,
        ["channel", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("status <> 'cancelled'"),
        sqlite_where=sa.text("status <> 'cancelled'"),
    )
    op.create_index("ix_publisher_jobs_status", table, ["status", "scheduled_at"])
    op.create_index("ix_publisher_jobs_parent", table, ["parent_id"])


def downgrade() -> None:
    op.drop_table(own_table("publisher_jobs"))
