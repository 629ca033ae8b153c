"""Conveyor's own corner of the database: tables, sequence and functions that earlier
revisions created in ``public`` move into Conveyor's schema (on SQLite: take its prefix)

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from conveyor.store.db.migrate import abandon, adopt

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# ``conveyor_counters`` already carries the prefix: SQLite keeps its name.
TABLES = ["jobs", "job_events", "dead_letters", "dedup_keys", "dedup_followers", "leases", "stages"]
PG_ONLY = ["conveyor_counters"]
SEQUENCES = ["conveyor_seq"]
FUNCTIONS = ["conveyor_claim(text, text, text)", "conveyor_sequence_events(integer)"]


def upgrade() -> None:
    adopt(TABLES, sequences=SEQUENCES, functions=FUNCTIONS)
    adopt(PG_ONLY, sqlite=False)


def downgrade() -> None:
    abandon(PG_ONLY, sqlite=False)
    abandon(TABLES, sequences=SEQUENCES, functions=FUNCTIONS)
