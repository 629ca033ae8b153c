"""throttled jobs: claimable, and in the relay's due index

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

CLAIM = """
CREATE OR REPLACE FUNCTION conveyor_claim(p_id text, p_owner text, p_task text)
RETURNS SETOF jobs LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  RETURN QUERY
    UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_owner = p_owner,
           heartbeat_at = clock_timestamp(), started_at = clock_timestamp(),
           updated_at = clock_timestamp(), celery_task_id = p_task
     WHERE id = p_id AND status IN ({statuses}) AND run_at <= clock_timestamp()
       AND cancel_requested_at IS NULL AND (expires_at IS NULL OR expires_at > clock_timestamp())
    RETURNING jobs.*;
END
$$;
"""


def _due_index(statuses: str) -> None:
    op.drop_index("ix_jobs_due", table_name="jobs")
    where = sa.text(f"published_at IS NULL AND status IN ({statuses})")
    op.create_index("ix_jobs_due", "jobs", ["run_at"], postgresql_where=where, sqlite_where=where)


def upgrade() -> None:
    statuses = "'queued', 'retrying', 'throttled'"
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM.format(statuses=statuses))
    _due_index(statuses)


def downgrade() -> None:
    statuses = "'queued', 'retrying'"
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM.format(statuses=statuses))
    _due_index(statuses)
