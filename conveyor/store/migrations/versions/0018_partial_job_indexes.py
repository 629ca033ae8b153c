"""index only the rows each lookup asks for, so a claim and a completion write fewer
index entries

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.migrate import own_table

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# A claim and a completion each change ``status``, which several indexes cover, so neither
# is a HOT update: the new row version gets an entry in every index whose predicate it
# matches. Before this, that was all 13 of them, twice per job. Each lookup these indexes
# serve only asks for part of the table, so each index now holds only that part: the
# claim writes 6 entries, the completion 5 (issue #16; the plans are checked by
# tests/integration/test_hot_path_plans.py).
#
# name: (columns, rows the lookups ask for, the old columns)
LIVE = "status IN ('queued', 'running', 'retrying', 'throttled', 'waiting_lease', 'waiting_dedup')"
WAITING = "status IN ('queued', 'retrying', 'throttled')"
PARTIAL = {
    # status-only lookups (stale leases, escalations, parked and following jobs)
    "ix_jobs_status_heartbeat": (["status", "heartbeat_at"], LIVE),
    # the relay's republish scans over waiting, published jobs
    "ix_jobs_status_published": (["status", "published_at"], WAITING),
    # the retention purge and the finished-jobs gauges
    "ix_jobs_finished": (["finished_at"], "finished_at IS NOT NULL"),
    # the hard time limit finds its running job by task id
    "ix_jobs_celery_task": (["celery_task_id"], "status = 'running'"),
    # jobs parked on a lease key
    "ix_jobs_parked": (["lease_key", "status", "priority"], "lease_key IS NOT NULL"),
    # an owner's jobs over HTTP
    "ix_jobs_owner_created": (["owner", "created_at"], "owner IS NOT NULL"),
}


def upgrade() -> None:
    jobs = own_table("jobs")
    for name, (columns, where) in PARTIAL.items():
        op.drop_index(name, table_name=jobs)
        op.create_index(name, jobs, columns, postgresql_where=sa.text(where), sqlite_where=sa.text(where))


def downgrade() -> None:
    jobs = own_table("jobs")
    for name, (columns, _) in PARTIAL.items():
        op.drop_index(name, table_name=jobs)
        op.create_index(name, jobs, columns)
