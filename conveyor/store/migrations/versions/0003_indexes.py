"""indexes for retention and hard-timeout lookups

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_events_created", "job_events", ["created_at"])
    op.create_index("ix_jobs_celery_task", "jobs", ["celery_task_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_celery_task", table_name="jobs")
    op.drop_index("ix_job_events_created", table_name="job_events")
