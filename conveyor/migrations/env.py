"""Alembic environment: the engine comes from ``conveyor.db.migrate``, never from a URL here."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from conveyor.db.schema import metadata

engine: Engine = context.config.attributes["engine"]
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
