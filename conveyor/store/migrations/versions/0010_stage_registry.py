"""the stage registry: each stage's queue, policy and payload JSON Schema, for clients
that submit by name without the stage code

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Rows are written by conveyor.client.registry (``conveyor db upgrade`` and each worker's start),
# never by this migration: it knows no stages. The same DDL serves Postgres and SQLite.


def upgrade() -> None:
    op.create_table(
        "stages",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("queue", sa.String(length=100), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("dedup", sa.JSON(), nullable=True),
        sa.Column("dedup_by_code", sa.Text(), nullable=True),
        sa.Column("lease_key", sa.String(length=200), nullable=True),
        sa.Column("preemptable", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("payload_schema", sa.JSON(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_stages"),
    )


def downgrade() -> None:
    op.drop_table("stages")
