"""The self-check family's one table: effects, deliberately without a unique constraint,
so that a duplicated effect would show up as a second row."""

from __future__ import annotations

from sqlalchemy import Column, Integer, MetaData, String, Table

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own
from conveyor.store.db.schema import BigId

# In Conveyor's schema (a prefix on SQLite), beside the platform's tables.
metadata = MetaData(schema=SCHEMA)

effects = Table(
    own("demo_effects"),
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(36), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("note", String(200), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
)
