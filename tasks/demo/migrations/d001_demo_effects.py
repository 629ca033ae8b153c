"""demo effects table

Revision ID: d001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp

revision = "d001"
down_revision = None
branch_labels = ("demo",)
depends_on = "0001"


def upgrade() -> None:
    op.create_table(
        "demo_effects",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("stage", sa.String(length=200), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("note", sa.String(length=200), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_demo_effects"),
    )
    op.create_index("ix_demo_effects_job", "demo_effects", ["job_id"])


def downgrade() -> None:
    op.drop_table("demo_effects")
