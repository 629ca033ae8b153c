"""the HTTP API's bearer tokens (hashed), and an owner on each job

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Adding a nullable column is instant on Postgres (no rewrite) and a plain ALTER TABLE on
# SQLite (batch mode adds it in place). conveyor_claim() returns SETOF jobs and follows the
# row type, so it needs no change.


def upgrade() -> None:
    jobs = own_table("jobs")
    with op.batch_alter_table(jobs) as batch:
        batch.add_column(sa.Column("owner", sa.String(length=64), nullable=True))
    op.create_index("ix_jobs_owner_created", jobs, ["owner", "created_at"])
    op.create_table(
        own_table("tokens"),
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("scopes", sa.String(length=200), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("revoked_at", Timestamp(), nullable=True),
        sa.Column("last_used_at", Timestamp(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_tokens"),
    )
    op.create_index("ix_tokens_owner", own_table("tokens"), ["owner"])


def downgrade() -> None:
    op.drop_index("ix_tokens_owner", table_name=own_table("tokens"))
    op.drop_table(own_table("tokens"))
    jobs = own_table("jobs")
    op.drop_index("ix_jobs_owner_created", table_name=jobs)
    with op.batch_alter_table(jobs) as batch:
        batch.drop_column("owner")
