"""Alembic environment: the engine comes from ``conveyor.db.migrate``, never from a URL here.

Conveyor's tables and its version table live in its own schema (a prefix on SQLite), the
one the engine renders them in (``CONVEYOR_DB_SCHEMA``)."""

from __future__ import annotations

from alembic import context
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from conveyor.db.migrate import SCHEMA_KEY, prepare, version_table
from conveyor.db.namespace import schema_of
from conveyor.db.schema import metadata

engine: Engine = context.config.attributes["engine"]
known = {rev.revision for rev in ScriptDirectory.from_config(context.config).walk_revisions()}
with engine.connect() as connection:
    schema = schema_of(connection)
    context.config.attributes[SCHEMA_KEY] = schema
    prepare(connection, schema, known)
    name, own_schema = version_table(connection, schema)
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        version_table=name,
        version_table_schema=own_schema,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
