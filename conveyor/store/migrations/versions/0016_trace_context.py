"""jobs keep the trace context of the span that created them (``traceparent`` and
``tracestate``): every publish carries it, so a job is one trace across republishes

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# A nullable column: instant on Postgres, in place on SQLite. conveyor_claim() returns
# SETOF jobs and follows the row type (see 0012).


def upgrade() -> None:
    with op.batch_alter_table(own_table("jobs")) as batch:
        batch.add_column(sa.Column("trace_context", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(own_table("jobs")) as batch:
        batch.drop_column("trace_context")
