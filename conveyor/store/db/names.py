"""The names of Conveyor's corner of a database, without SQLAlchemy: the settings validate
``db_schema`` with them, and reading the settings must not import a database toolkit
(``conveyor --help``). :mod:`conveyor.db.namespace` renders them; it re-exports these."""

from __future__ import annotations

import re

SCHEMA = "conveyor"  # the placeholder every table is declared in, and the default schema
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def checked_schema(name: str) -> str:
    """``name`` if it is a plain lower-case identifier (it is spliced into SQL)."""
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"database schema {name!r} must be a lower-case identifier (letters, digits, _)")
    return name


def sqlite_prefix(schema: str) -> str:
    """The table prefix standing in for ``schema`` on SQLite: ``conveyor`` → ``conveyor_``."""
    return f"{schema}_"


__all__ = ["SCHEMA", "checked_schema", "sqlite_prefix"]
