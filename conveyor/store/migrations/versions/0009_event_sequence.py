"""event positions numbered after commit: ``job_events.seq`` replaces ``txid``

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import EVENT_TXID_DEFAULT_PG

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Readers used to see only events of transactions older than the oldest one still running,
# so one long transaction held back every other job's events. Now writers leave ``seq``
# NULL and this sequencer numbers committed events; a transaction still open is invisible
# to it, and its events are numbered when it has committed, after those committed before.
#
# One sequencer at a time (a transaction-level advisory lock, taken before the statement
# that reads what is pending, so that statement's snapshot sees every earlier numbering):
# a committed number is never below a number still uncommitted, so a reader's snapshot
# always holds a prefix of the numbering and paging by ``seq > cursor`` skips nothing.
# Postgres releases the lock only after the commit is visible. The commit is synchronous:
# a numbering lost in a crash would hand its numbers out again, to other events.
SEQUENCER = """
CREATE OR REPLACE FUNCTION conveyor_sequence_events(p_limit integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
  v_numbered integer;
BEGIN
  PERFORM 1 FROM job_events WHERE seq IS NULL LIMIT 1;
  IF NOT FOUND THEN
    RETURN 0;
  END IF;
  PERFORM pg_advisory_xact_lock(1702261875);  -- 'evts'
  PERFORM set_config('synchronous_commit', 'on', true);
  -- A missing counter (never created, or deleted) resumes above every number given out.
  INSERT INTO conveyor_counters (name, value)
    SELECT 'event_seq', coalesce(max(seq), 0) FROM job_events
  ON CONFLICT (name) DO NOTHING;
  WITH pending AS (
    SELECT id, row_number() OVER (ORDER BY id) AS rn
      FROM job_events WHERE seq IS NULL ORDER BY id LIMIT p_limit
  ), total AS (
    SELECT count(*) AS cnt FROM pending
  ), top AS (
    INSERT INTO conveyor_counters AS c (name, value)
    SELECT 'event_seq', total.cnt FROM total WHERE total.cnt > 0
    ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
    RETURNING c.value AS value
  )
  UPDATE job_events AS e SET seq = top.value - total.cnt + pending.rn
    FROM pending, total, top
   WHERE e.id = pending.id;
  GET DIAGNOSTICS v_numbered = ROW_COUNT;
  RETURN v_numbered;
END
$$;
"""

# Existing events keep the order readers saw them in, (txid, id), numbered above anything
# numbered before (a downgrade and upgrade again never reissues a number). A cursor from
# before this migration names an event id; conveyor.store.events maps it to that event's seq.
BACKFILL = """
UPDATE job_events AS e
   SET seq = o.rn + coalesce((SELECT value FROM conveyor_counters WHERE name = 'event_seq'), 0)
  FROM (SELECT id, row_number() OVER (ORDER BY txid, id) AS rn FROM job_events) AS o
 WHERE e.id = o.id
"""

COUNTER = """
INSERT INTO conveyor_counters AS c (name, value)
SELECT 'event_seq', coalesce(max(seq), 0) FROM job_events
ON CONFLICT (name) DO UPDATE SET value = greatest(c.value, EXCLUDED.value)
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        # One writer at a time: id order is commit order and stays the position. The copy
        # gains AUTOINCREMENT so a purge of the newest rows never lets an id come back.
        with op.batch_alter_table(
            "job_events", recreate="always", table_kwargs={"sqlite_autoincrement": True}
        ) as batch:
            batch.drop_index("ix_job_events_position")
            batch.drop_index("ix_job_events_job")
            batch.drop_column("txid")
            batch.add_column(sa.Column("seq", sa.BigInteger(), nullable=True))
            batch.create_index(
                "ix_job_events_seq", ["seq"], unique=True, sqlite_where=sa.text("seq IS NOT NULL")
            )
            batch.create_index("ix_job_events_job", ["job_id", "seq"])
        return
    op.add_column("job_events", sa.Column("seq", sa.BigInteger(), nullable=True))
    op.execute(BACKFILL)
    op.execute(COUNTER)
    op.drop_index("ix_job_events_position", table_name="job_events")
    op.drop_index("ix_job_events_job", table_name="job_events")
    op.drop_column("job_events", "txid")
    op.create_index(
        "ix_job_events_seq", "job_events", ["seq"], unique=True, postgresql_where=sa.text("seq IS NOT NULL")
    )
    op.create_index("ix_job_events_job", "job_events", ["job_id", "seq"])
    op.create_index("ix_job_events_pending", "job_events", ["id"], postgresql_where=sa.text("seq IS NULL"))
    op.execute(SEQUENCER)


def downgrade() -> None:
    # Existing rows get txid 0 (id order, before every new event); cursors issued since
    # the upgrade mean nothing to the old readers. The counter row stays, so numbers only
    # ever grow across an upgrade again.
    if op.get_bind().dialect.name != "postgresql":
        with op.batch_alter_table("job_events", recreate="always") as batch:
            batch.drop_index("ix_job_events_seq")
            batch.drop_index("ix_job_events_job")
            batch.drop_column("seq")
            batch.add_column(sa.Column("txid", sa.BigInteger(), nullable=False, server_default=sa.text("0")))
            batch.create_index("ix_job_events_job", ["job_id", "id"])
            batch.create_index("ix_job_events_position", ["txid", "id"])
        return
    op.execute("DROP FUNCTION IF EXISTS conveyor_sequence_events(integer)")
    op.drop_index("ix_job_events_pending", table_name="job_events")
    op.drop_index("ix_job_events_job", table_name="job_events")
    op.drop_index("ix_job_events_seq", table_name="job_events")
    op.add_column(
        "job_events", sa.Column("txid", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
    )
    op.alter_column("job_events", "txid", server_default=sa.text(EVENT_TXID_DEFAULT_PG))
    op.drop_column("job_events", "seq")
    op.create_index("ix_job_events_job", "job_events", ["job_id", "id"])
    op.create_index("ix_job_events_position", "job_events", ["txid", "id"])
