"""Conveyor's corner of a shared database: a Postgres schema, or a table prefix on SQLite.

Tables are declared in the placeholder schema :data:`SCHEMA` with names made by
:func:`own`. On Postgres they render as ``conveyor.jobs`` (another schema through a
``schema_translate_map``), so a statement is correct on any connection, a caller's
included. Conveyor's own Postgres connections also put the schema first on their
``search_path`` for the raw SQL of migrations and functions. SQLite has no schemas: there
the identifier preparer installed by :func:`namespace_dialect` renders ``conveyor_jobs``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Dialect, Table, inspect, text
from sqlalchemy.dialects.sqlite.base import SQLiteIdentifierPreparer
from sqlalchemy.sql.elements import quoted_name

from conveyor.settings import SCHEMA, checked_schema, sqlite_prefix

TRANSLATE = "schema_translate_map"


class OwnName(quoted_name):
    """A table name that takes the SQLite prefix (a ``str``, equal to the bare name)."""

    __slots__ = ()

    def __new__(cls, value: str) -> OwnName:
        self: OwnName = str.__new__(cls, value)
        self.quote = None
        return self

    def __reduce__(self) -> Any:
        return OwnName, (str(self),)


def own(name: str) -> OwnName:
    """The name of one of Conveyor's (or a deployment's) tables: ``Table(own("jobs"), …)``."""
    return OwnName(name)


class _PrefixingPreparer(SQLiteIdentifierPreparer):
    """SQLite: tables of the placeholder schema lose the schema and gain the prefix."""

    def __init__(self, dialect: Dialect, prefix: str) -> None:
        super().__init__(dialect)
        self.conveyor_prefix = prefix

    def quote(self, ident: str) -> str:
        if isinstance(ident, OwnName):
            return super().quote(self.conveyor_prefix + str(ident))
        return super().quote(ident)

    def schema_for_object(self, obj: Any) -> Any:  # type: ignore[override]
        schema = getattr(obj, "schema", None)
        # "main", not None: a table without a schema would be aliased in SELECTs (see
        # Select._normalize_froms), and a correlated reference to it named by its alias.
        return "main" if schema == SCHEMA else schema


def namespace_dialect(dialect: Dialect, schema: str) -> None:
    """Make ``dialect`` (a SQLite one) render Conveyor's tables with ``schema``'s prefix.
    Idempotent; only names made by :func:`own` and the placeholder schema change."""
    if dialect.name != "sqlite":
        return
    prefix = sqlite_prefix(schema)
    current = dialect.identifier_preparer
    if isinstance(current, _PrefixingPreparer) and current.conveyor_prefix == prefix:
        return
    dialect.identifier_preparer = _PrefixingPreparer(dialect, prefix)


def translate_map(schema: str) -> dict[str | None, str | None] | None:
    """The ``schema_translate_map`` for ``schema``, or ``None`` for the default one."""
    return None if schema == SCHEMA else {SCHEMA: schema}


def schema_of(conn: Connection) -> str:
    """The schema Conveyor's tables are in, as ``conn`` renders them."""
    if conn.dialect.name == "sqlite":
        preparer = conn.dialect.identifier_preparer
        prefix = getattr(preparer, "conveyor_prefix", sqlite_prefix(SCHEMA))
        return str(prefix)[:-1]
    mapping = conn.get_execution_options().get(TRANSLATE) or {}
    return str(mapping.get(SCHEMA) or SCHEMA)


def use_schema(conn: Connection, schema: str) -> Connection:
    """Make ``conn`` (a caller's, say) render Conveyor's tables in ``schema``."""
    if conn.dialect.name == "sqlite":
        namespace_dialect(conn.dialect, schema)
    elif schema != schema_of(conn):
        conn.execution_options(**{TRANSLATE: translate_map(schema) or {}})
    return conn


def physical_name(conn: Connection, table: Table) -> tuple[str | None, str]:
    """``(schema, name)`` of ``table`` as it exists in ``conn``'s database."""
    if conn.dialect.name == "sqlite":
        prefix = sqlite_prefix(schema_of(conn)) if isinstance(table.name, OwnName) else ""
        return None, prefix + str(table.name)
    return (schema_of(conn) if table.schema == SCHEMA else table.schema), str(table.name)


def table_exists(conn: Connection, table: Table) -> bool:
    """Whether ``table`` exists yet (before ``conveyor db upgrade``, it may not)."""
    schema, name = physical_name(conn, table)
    if schema is not None:
        found = conn.execute(text("SELECT to_regclass(:n) IS NOT NULL"), {"n": f'"{schema}"."{name}"'})
        return bool(found.scalar_one())
    return inspect(conn).has_table(name)


__all__ = [
    "SCHEMA",
    "TRANSLATE",
    "OwnName",
    "checked_schema",
    "namespace_dialect",
    "own",
    "physical_name",
    "schema_of",
    "sqlite_prefix",
    "table_exists",
    "translate_map",
    "use_schema",
]
