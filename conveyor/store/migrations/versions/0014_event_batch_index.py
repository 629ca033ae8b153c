"""an index for the event feed's batch filter: events by the ``batch_id`` their body carries,
in commit order (the other filters have theirs: ``ix_job_events_job``, ``ix_jobs_flow``,
``ix_jobs_owner_created``)

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# The expressions are conveyor.web.feed's, character for character: a planner uses an
# expression index only for the very expression it indexes. Postgres: only events that
# carry one (most do not); its order column is seq, SQLite's id.


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.create_index(
            "ix_job_events_batch",
            own_table("job_events"),
            [sa.text("json_extract(body, '$.batch_id')"), sa.text("id")],
        )
    else:
        op.create_index(
            "ix_job_events_batch",
            own_table("job_events"),
            [sa.text("(body ->> 'batch_id')"), sa.text("seq")],
            postgresql_where=sa.text("(body ->> 'batch_id') IS NOT NULL"),
        )


def downgrade() -> None:
    op.drop_index("ix_job_events_batch", own_table("job_events"))
