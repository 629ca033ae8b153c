"""the stage registry keeps what a client applies at submit beyond the schema: a strict
idempotency rule (refusing a conflicting submit as the deployment would) and whether the
stage masks its messages' kwargsrepr

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table(own_table("stages")) as batch:
        batch.add_column(sa.Column("submit_rules", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(own_table("stages")) as batch:
        batch.drop_column("submit_rules")
