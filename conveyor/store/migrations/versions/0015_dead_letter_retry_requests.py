"""dead letters take retry requests: a client (the HTTP API) that may not run a stage's
``on_retry`` hook records the request, and a worker's relay, which has the deployment's
code, performs it (or records why it refused)

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table(own_table("dead_letters")) as batch:
        batch.add_column(sa.Column("retry_requested_at", Timestamp(), nullable=True))
        batch.add_column(sa.Column("retry_requested_by", sa.String(200), nullable=True))
        batch.add_column(sa.Column("retry_refused", sa.Text(), nullable=True))
        batch.create_index("ix_dead_letters_requested", ["retry_requested_at"])


def downgrade() -> None:
    with op.batch_alter_table(own_table("dead_letters")) as batch:
        batch.drop_index("ix_dead_letters_requested")
        batch.drop_column("retry_refused")
        batch.drop_column("retry_requested_by")
        batch.drop_column("retry_requested_at")
