"""claim in one round trip (Postgres)

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The claim commits without waiting for the WAL flush: every later write of the same
# attempt commits synchronously and flushes it first, so a claim lost in a crash is one
# nothing was recorded under (see conveyor.store.db.dialect.relax_commit).
CLAIM = """
CREATE OR REPLACE FUNCTION conveyor_claim(p_id text, p_owner text, p_task text)
RETURNS SETOF jobs LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  RETURN QUERY
    UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_owner = p_owner,
           heartbeat_at = clock_timestamp(), started_at = clock_timestamp(),
           updated_at = clock_timestamp(), celery_task_id = p_task
     WHERE id = p_id AND status IN ('queued', 'retrying') AND run_at <= clock_timestamp()
       AND cancel_requested_at IS NULL AND (expires_at IS NULL OR expires_at > clock_timestamp())
    RETURNING jobs.*;
END
$$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION conveyor_claim(text, text, text)")
