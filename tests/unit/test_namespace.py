"""How Conveyor's tables render: schema-qualified on Postgres (on any connection, a
caller's included), prefixed on SQLite, and never as a bare name an app may also use."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql

from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.namespace import namespace_dialect
from conveyor.store.db.schema import dedup_keys, jobs


def test_postgres_qualifies_with_the_schema_even_on_a_plain_dialect() -> None:
    sql = str(select(jobs.c.id).compile(dialect=postgresql.dialect()))
    assert "FROM conveyor.jobs" in sql


def test_postgres_renders_another_schema_through_the_engine() -> None:
    engine = make_engine("postgresql://nobody@127.0.0.1:1/x", schema="tenant_jobs")  # never connects
    assert engine.get_execution_options()["schema_translate_map"] == {"conveyor": "tenant_jobs"}
    assert (
        make_engine("postgresql://nobody@127.0.0.1:1/x").get_execution_options()["schema_translate_map"]
        is None
    )


def test_sqlite_prefixes_every_reference(tmp_path: Path) -> None:
    engine = make_engine(sqlite_url(tmp_path))
    inner = select(dedup_keys.c.key).where(dedup_keys.c.job_id == jobs.c.id)
    sql = str(update(jobs).where(inner.exists()).values(status="x").compile(engine))
    assert "main.conveyor_jobs" in sql and "main.conveyor_dedup_keys.job_id = main.conveyor_jobs.id" in sql
    assert " jobs" not in sql.replace("conveyor_jobs", "")


def test_a_callers_sqlite_engine_learns_the_prefix(tmp_path: Path) -> None:
    plain = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    namespace_dialect(plain.dialect, "tenant")
    assert "main.tenant_jobs" in str(select(jobs.c.id).compile(plain))
    namespace_dialect(plain.dialect, "tenant")  # idempotent
    assert "main.tenant_jobs" in str(select(jobs.c.id).compile(plain))
