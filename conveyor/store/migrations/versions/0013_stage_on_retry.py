"""whether a registered stage has an ``on_retry`` hook (a client retries a dead letter only
when it has none)

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Nullable: rows written before this revision say nothing (NULL), and a client treats that
# as "may have a hook" until a worker's start or `conveyor db upgrade` rewrites the row.


def upgrade() -> None:
    with op.batch_alter_table(own_table("stages")) as batch:
        batch.add_column(sa.Column("on_retry", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(own_table("stages")) as batch:
        batch.drop_column("on_retry")
