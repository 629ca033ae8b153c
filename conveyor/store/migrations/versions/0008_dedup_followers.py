"""dedup followers: a job that must wait for another job holding its dedup id

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A chain link, link callback or chord member deduplicated into a live holder: it waits
    # in status 'waiting_dedup' and takes the holder's outcome when the holder is terminal.
    op.create_table(
        "dedup_followers",
        sa.Column("job_id", sa.String(length=36), primary_key=True),
        sa.Column("holder", sa.String(length=36), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    op.create_index("ix_dedup_followers_holder", "dedup_followers", ["holder"])


def downgrade() -> None:
    op.drop_index("ix_dedup_followers_holder", table_name="dedup_followers")
    op.drop_table("dedup_followers")
