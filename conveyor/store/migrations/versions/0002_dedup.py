"""dedup keys

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dedup_keys",
        sa.Column("scope", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=True),
        sa.Column("first_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", name="pk_dedup_keys"),
    )
    op.create_index("ix_dedup_keys_job", "dedup_keys", ["job_id"])
    op.create_index("ix_dedup_keys_expires", "dedup_keys", ["expires_ms"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("dedup_key", sa.String(length=420), nullable=True))
        batch.add_column(sa.Column("dedup_seq", sa.BigInteger(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE conveyor_seq")
    else:
        op.create_table(
            "conveyor_counters",
            sa.Column("name", sa.String(length=50), primary_key=True),
            sa.Column("value", sa.BigInteger(), nullable=False),
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP SEQUENCE conveyor_seq")
    else:
        op.drop_table("conveyor_counters")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("dedup_seq")
        batch.drop_column("dedup_key")
    op.drop_table("dedup_keys")
