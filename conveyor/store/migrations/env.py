"""Alembic environment: the engine comes from ``conveyor.store.db.migrate``, never from a URL here.

Conveyor's tables and its version table live in its own schema (a prefix on SQLite), the
one the engine renders them in (``CONVEYOR_DB_SCHEMA``). Revisions of branches this
process does not have (another deployment's families) are left as they are."""

from __future__ import annotations

from pathlib import Path

from alembic import context
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from conveyor.store.db.migrate import MIGRATIONS, SCHEMA_KEY, prepare, put_back, set_aside, version_table
from conveyor.store.db.namespace import schema_of
from conveyor.store.db.schema import metadata

engine: Engine = context.config.attributes["engine"]
revisions = list(ScriptDirectory.from_config(context.config).walk_revisions())
known = {rev.revision for rev in revisions}
platform = {rev.revision for rev in revisions if Path(rev.path).resolve().parent == MIGRATIONS / "versions"}
with engine.connect() as connection:
    schema = schema_of(connection)
    context.config.attributes[SCHEMA_KEY] = schema
    prepare(connection, schema, known)
    foreign = set_aside(connection, schema, known, platform)
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
    put_back(connection, schema, foreign)
    connection.commit()
