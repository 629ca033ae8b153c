"""leases for preemption and cancellation requests

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("holder_job", sa.String(length=36), nullable=True),
        sa.Column("holder_attempt", sa.Integer(), nullable=True),
        sa.Column("token", sa.BigInteger(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("preemptable", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("heartbeat_at", Timestamp(), nullable=True),
        sa.Column("reserved_job", sa.String(length=36), nullable=True),
        sa.Column("reserved_priority", sa.Integer(), nullable=True),
        sa.Column("reserved_until", Timestamp(), nullable=True),
        sa.PrimaryKeyConstraint("key", name="pk_leases"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lease_key", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("preempt_requested_at", Timestamp(), nullable=True))
        batch.add_column(sa.Column("interrupt_sent_at", Timestamp(), nullable=True))
    op.create_index("ix_jobs_parked", "jobs", ["lease_key", "status", "priority"])


def downgrade() -> None:
    op.drop_index("ix_jobs_parked", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("interrupt_sent_at")
        batch.drop_column("preempt_requested_at")
        batch.drop_column("lease_key")
    op.drop_table("leases")
