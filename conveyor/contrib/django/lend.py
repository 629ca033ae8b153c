"""Django's database connection lent to SQLAlchemy, inside Django's transaction.

SQLAlchemy may run statements on it; it never begins, commits, rolls back or closes it
(Django does). Two things SQLAlchemy would otherwise do are avoided: its first connect
initialises the dialect and then rolls back (which would erase the caller's uncommitted
rows), so the dialect comes initialised from Conveyor's own engine on a separate
connection; and its pool resets a connection it gets back, so this pool never resets."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections
from sqlalchemy import Connection, Engine
from sqlalchemy.pool import NullPool


class _Lent:
    """A DB-API connection whose transaction and life belong to someone else."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        if type(self._raw).__module__.startswith("psycopg"):
            import psycopg
            from psycopg.types.json import JsonbLoader, JsonLoader

            # SQLAlchemy's own kind of cursor (server-side binding), and JSON decoded by the
            # driver as SQLAlchemy expects; Django's connection keeps its adapters.
            cursor = psycopg.Cursor(self._raw)
            cursor.adapters.register_loader("json", JsonLoader)
            cursor.adapters.register_loader("jsonb", JsonbLoader)
            return cursor
        return self._raw.cursor(*args, **kwargs)

    def commit(self) -> None:
        """Django commits."""

    def rollback(self) -> None:
        """Django rolls back."""

    def close(self) -> None:
        """Django closes."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class Lender:
    """SQLAlchemy connections on Django's connection ``alias``, rendering like ``engine``
    (Conveyor's own engine on the same database: its dialect, schema and options)."""

    def __init__(self, engine: Engine, alias: str) -> None:
        with engine.connect():
            pass  # initialises the dialect here, on a connection of its own
        self.alias = alias
        pool = NullPool(self._lend, reset_on_return=None, dialect=engine.dialect)
        self.engine = Engine(
            pool, engine.dialect, engine.url, execution_options=engine.get_execution_options()
        )

    def _lend(self) -> _Lent:
        conn = connections[self.alias]
        conn.ensure_connection()
        return _Lent(conn.connection)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A SQLAlchemy connection inside the current Django transaction of ``alias``."""
        with self.engine.connect() as conn:
            yield conn
