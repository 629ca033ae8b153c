"""counted and uncounted attempts; a durable claim that starts with no stop request;
the relay's pass clock on Postgres

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# ``attempts`` counts claims (the fencing token); ``uncounted`` how many of them ended
# without counting (an outage, a shutdown, a preemption, parking); ``requeues`` how many
# of those an outage or a shutdown caused (bounded by the max_requeues setting).
#
# The claim commits synchronously: a claim lost in a database crash would let the next
# claim reissue the same attempt number while the old attempt may still write. A new
# attempt starts without the previous attempt's preemption request or interrupt.
CLAIM = """
CREATE OR REPLACE FUNCTION conveyor_claim(p_id text, p_owner text, p_task text)
RETURNS SETOF jobs LANGUAGE plpgsql AS $$
BEGIN
  RETURN QUERY
    UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_owner = p_owner,
           heartbeat_at = clock_timestamp(), started_at = clock_timestamp(),
           updated_at = clock_timestamp(), celery_task_id = p_task,
           preempt_requested_at = NULL, interrupt_sent_at = NULL
     WHERE id = p_id AND status IN ('queued', 'retrying', 'throttled') AND run_at <= clock_timestamp()
       AND cancel_requested_at IS NULL AND (expires_at IS NULL OR expires_at > clock_timestamp())
    RETURNING jobs.*;
END
$$;
"""

OLD_CLAIM = """
CREATE OR REPLACE FUNCTION conveyor_claim(p_id text, p_owner text, p_task text)
RETURNS SETOF jobs LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  RETURN QUERY
    UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_owner = p_owner,
           heartbeat_at = clock_timestamp(), started_at = clock_timestamp(),
           updated_at = clock_timestamp(), celery_task_id = p_task
     WHERE id = p_id AND status IN ('queued', 'retrying', 'throttled') AND run_at <= clock_timestamp()
       AND cancel_requested_at IS NULL AND (expires_at IS NULL OR expires_at > clock_timestamp())
    RETURNING jobs.*;
END
$$;
"""


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        # The function returns SETOF jobs: drop it before the row type changes.
        op.execute("DROP FUNCTION IF EXISTS conveyor_claim(text, text, text)")
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("uncounted", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("requeues", sa.Integer(), nullable=False, server_default="0"))
    if postgres:
        op.execute(CLAIM)
        # The relay's pass clock (conveyor.store.liveness) lives here; SQLite has it since 0002.
        op.create_table(
            "conveyor_counters",
            sa.Column("name", sa.String(length=50), primary_key=True),
            sa.Column("value", sa.BigInteger(), nullable=False),
        )


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.drop_table("conveyor_counters")
        op.execute("DROP FUNCTION IF EXISTS conveyor_claim(text, text, text)")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("requeues")
        batch.drop_column("uncounted")
    if postgres:
        op.execute(OLD_CLAIM)
