"""Run the platform's Alembic migrations programmatically (``conveyor db upgrade``), and
the helpers migrations use to keep Conveyor's tables in its own schema (or prefix)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from alembic import command, op
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text

from conveyor.errors import ConfigurationError
from conveyor.store.db.namespace import schema_of, sqlite_prefix

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
SCHEMA_KEY = "conveyor_schema"  # the Alembic config attribute env.py sets
VERSION_TABLE = "alembic_version"


def alembic_config(engine: Engine, extra_locations: list[Path] | None = None) -> Config:
    """An Alembic config bound to ``engine``; deployments may add version locations."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    locations = [MIGRATIONS / "versions", *(extra_locations or [])]
    cfg.set_main_option("version_locations", " ".join(str(p) for p in locations))
    cfg.set_main_option("path_separator", "space")
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, extra_locations: list[Path] | None = None) -> None:
    """Bring the database to the newest revision of every migration branch."""
    command.upgrade(alembic_config(engine, extra_locations), "heads")


def pending(engine: Engine) -> list[str]:
    """The platform's revisions this database has yet to apply, oldest first."""
    script = ScriptDirectory.from_config(alembic_config(engine))
    with engine.connect() as conn:
        name, own_schema = version_table(conn, schema_of(conn))
        rows: set[str] = set()
        if inspect(conn).has_table(name, schema=own_schema):
            rows = set(
                conn.execute(text(f"SELECT version_num FROM {_qualified(name, own_schema)}")).scalars()
            )
    applied: set[str] = set()
    for head in rows:
        if head in {rev.revision for rev in script.walk_revisions()}:
            applied |= {rev.revision for rev in script.iterate_revisions(head, "base")}
    return [rev.revision for rev in reversed(list(script.walk_revisions())) if rev.revision not in applied]


def version_table(conn: Connection, schema: str) -> tuple[str, str | None]:
    """``(name, schema)`` of Conveyor's own Alembic version table."""
    if conn.dialect.name == "sqlite":
        return sqlite_prefix(schema) + VERSION_TABLE, None
    return VERSION_TABLE, schema


def prepare(conn: Connection, schema: str, known: set[str]) -> None:
    """Before migrating: create the schema (Postgres) and put it first on this connection's
    search_path, so migrations that name tables bare create and find them there. A
    database migrated before the schema existed keeps its history: our revisions move
    from the shared ``alembic_version`` into our own version table."""
    if conn.dialect.name != "sqlite":
        present = conn.execute(text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}).first()
        if present is None:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(text(f'SET search_path TO "{schema}", public'))
    name, own_schema = version_table(conn, schema)
    legacy_schema = None if conn.dialect.name == "sqlite" else "public"
    if (name, own_schema) == (VERSION_TABLE, legacy_schema):
        return  # the schema is public itself: nothing to move
    look = inspect(conn)
    if look.has_table(name, schema=own_schema) or not look.has_table(VERSION_TABLE, schema=legacy_schema):
        return
    legacy = f"{legacy_schema}.{VERSION_TABLE}" if legacy_schema else VERSION_TABLE
    ours = [v for v in conn.execute(text(f"SELECT version_num FROM {legacy}")).scalars() if v in known]
    if not ours:
        return  # another tool's history, not ours
    target = f'"{own_schema}"."{name}"' if own_schema else f'"{name}"'
    conn.execute(
        text(
            f"CREATE TABLE {target} (version_num VARCHAR(32) NOT NULL, "
            "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
        )
    )
    for version in ours:
        conn.execute(text(f"INSERT INTO {target} (version_num) VALUES (:v)"), {"v": version})
        conn.execute(text(f"DELETE FROM {legacy} WHERE version_num = :v"), {"v": version})
    if conn.execute(text(f"SELECT count(*) FROM {legacy}")).scalar_one() == 0:
        conn.execute(text(f"DROP TABLE {legacy}"))


def set_aside(conn: Connection, schema: str, known: set[str], platform: set[str]) -> list[str]:
    """Take out of the version table, for this transaction, the revisions this process does
    not know: another deployment's families on the same database (each deployment upgrades
    the branches it has, and leaves the others as they are). Put them back with
    :func:`put_back` before committing. A database whose platform revision is unknown was
    migrated by a newer Conveyor: refused, never migrated from scratch beside it."""
    name, own_schema = version_table(conn, schema)
    if not inspect(conn).has_table(name, schema=own_schema):
        return []
    table = _qualified(name, own_schema)
    rows = set(conn.execute(text(f"SELECT version_num FROM {table}")).scalars())
    foreign = sorted(rows - known)
    if foreign and not rows & platform:
        raise ConfigurationError(
            f"this database was migrated by a newer Conveyor (revision {', '.join(foreign)} is unknown "
            "here): upgrade Conveyor before running its migrations"
        )
    for version in foreign:
        conn.execute(text(f"DELETE FROM {table} WHERE version_num = :v"), {"v": version})
    return foreign


def put_back(conn: Connection, schema: str, foreign: list[str]) -> None:
    """Return the revisions :func:`set_aside` took out."""
    table = _qualified(*version_table(conn, schema))
    for version in foreign:
        conn.execute(text(f"INSERT INTO {table} (version_num) VALUES (:v)"), {"v": version})


def _qualified(name: str, schema: str | None) -> str:
    return f'"{schema}"."{name}"' if schema else f'"{name}"'


def own_table(name: str) -> str:
    """In a migration after 0011: the name of Conveyor's table ``name`` as it exists now.
    On Postgres the bare name (the migration's search_path starts with Conveyor's schema);
    on SQLite the prefixed one (``conveyor_jobs``), which Alembic's ops do not add."""
    conn = op.get_bind()
    if conn.dialect.name != "sqlite":
        return name
    schema: str = op.get_context().config.attributes[SCHEMA_KEY]  # type: ignore[union-attr]
    return sqlite_prefix(schema) + name


def adopt(
    tables: Sequence[str],
    *,
    sequences: Sequence[str] = (),
    functions: Sequence[str] = (),
    sqlite: bool = True,
) -> None:
    """In a migration: move ``tables`` (and Postgres ``sequences`` and ``functions``, given
    with their argument types) that an older Conveyor created in ``public`` into Conveyor's
    schema, or on SQLite (unless not ``sqlite``) rename them to carry its prefix. What is
    already there is left."""
    _move(tables, sequences, functions, back=False, sqlite=sqlite)


def abandon(
    tables: Sequence[str],
    *,
    sequences: Sequence[str] = (),
    functions: Sequence[str] = (),
    sqlite: bool = True,
) -> None:
    """The downgrade of :func:`adopt`: the objects go back to ``public`` (unprefixed)."""
    _move(tables, sequences, functions, back=True, sqlite=sqlite)


def _move(
    tables: Sequence[str], sequences: Sequence[str], functions: Sequence[str], *, back: bool, sqlite: bool
) -> None:
    conn = op.get_bind()
    schema: str = op.get_context().config.attributes[SCHEMA_KEY]  # type: ignore[union-attr]
    if conn.dialect.name == "sqlite":
        if not sqlite:
            return
        prefix = sqlite_prefix(schema)
        names = inspect(conn).get_table_names()
        for table in tables:
            old, new = (prefix + table, table) if back else (table, prefix + table)
            if old in names and new not in names:
                conn.execute(text(f'ALTER TABLE "{old}" RENAME TO "{new}"'))
        return
    if schema == "public":
        return
    source, target = (schema, "public") if back else ("public", schema)
    kinds = [("TABLE", t, "to_regclass") for t in tables]
    kinds += [("SEQUENCE", q, "to_regclass") for q in sequences]
    kinds += [("FUNCTION", f, "to_regprocedure") for f in functions]
    for kind, name, lookup in kinds:
        found = text(f"SELECT {lookup}(:n) IS NOT NULL")
        here = conn.execute(found, {"n": f'"{source}".{name}'}).scalar_one()
        there = conn.execute(found, {"n": f'"{target}".{name}'}).scalar_one()
        if here and not there:
            conn.execute(text(f'ALTER {kind} "{source}".{name} SET SCHEMA "{target}"'))
