"""an index for the relay's broker-epoch scans: waiting jobs that were published, by the
epoch they were published under

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.db.migrate import own_table

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Every relay pass looks for waiting jobs published under another epoch (a wiped broker)
# and, four times per ``republish_after``, for those published under this one too long
# ago. Both went through the status index and read every waiting job's row: with a backlog
# of 100k queued jobs, 12 ms a pass that finds nothing. This partial index holds only the
# waiting, published jobs (the backlog, never the terminal history); the relay asks for
# ``broker_epoch < e OR broker_epoch > e`` (not ``<>``, which no index answers), so a pass
# that finds nothing reads nothing (issue #16, tests/integration/test_hot_path_plans.py).
WHERE = "published_at IS NOT NULL AND status IN ('queued', 'retrying', 'throttled')"


def upgrade() -> None:
    op.create_index(
        "ix_jobs_published_epoch",
        own_table("jobs"),
        ["broker_epoch", "published_at"],
        postgresql_where=sa.text(WHERE),
        sqlite_where=sa.text(WHERE),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_published_epoch", own_table("jobs"))
