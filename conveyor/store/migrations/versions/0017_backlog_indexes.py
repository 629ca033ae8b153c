"""indexes for the periodic scans over waiting jobs, so a big backlog is not read on every
pass: waiting published jobs by broker epoch (the relay), waiting jobs that can expire by
expiry (the reconciler)

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Every relay pass looks for waiting jobs published under another epoch (a wiped broker)
# and, four times per ``republish_after``, for those published under this one too long
# ago; every reconciler pass for waiting jobs past ``expires_at``. Each went through the
# status index and read every waiting job's row: with a backlog of 100k queued jobs,
# 12 ms and 35 ms a pass that found nothing. These partial indexes hold only waiting jobs
# (never the terminal history), and the relay asks for ``broker_epoch < e OR
# broker_epoch > e`` (not ``<>``, which no index answers), so a pass that finds nothing
# reads nothing (issue #16, tests/integration/test_hot_path_plans.py).
WAITING = "status IN ('queued', 'retrying', 'throttled')"
PUBLISHED = f"published_at IS NOT NULL AND {WAITING}"
EXPIRING = f"expires_at IS NOT NULL AND {WAITING}"


def upgrade() -> None:
    jobs = own_table("jobs")
    op.create_index(
        "ix_jobs_published_epoch",
        jobs,
        ["broker_epoch", "published_at"],
        postgresql_where=sa.text(PUBLISHED),
        sqlite_where=sa.text(PUBLISHED),
    )
    op.create_index(
        "ix_jobs_expiring",
        jobs,
        ["expires_at"],
        postgresql_where=sa.text(EXPIRING),
        sqlite_where=sa.text(EXPIRING),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_expiring", own_table("jobs"))
    op.drop_index("ix_jobs_published_epoch", own_table("jobs"))
