"""Conveyor's corner of a shared database: its tables, sequence, functions and Alembic
history live in their own Postgres schema (a prefix on SQLite), beside an app that has its
own ``jobs`` table and its own ``alembic_version``; a database migrated by an older
Conveyor (everything in ``public``) moves there with its data and its history."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

import conveyor
from config.migrations import FAMILY_MIGRATIONS, upgrade
from conveyor.client import registry
from conveyor.errors import ConfigurationError
from conveyor.settings import ConveyorSettings
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.migrate import alembic_config
from conveyor.store.db.migrate import upgrade as platform_upgrade
from tasks.files.search import lexical
from tests.helpers import bound_to, eventually, scratch_database

pytestmark = pytest.mark.timeout(180)

OURS = {"jobs", "job_events", "dead_letters", "dedup_keys", "dedup_followers", "leases", "stages"}
OURS |= {"conveyor_counters", "demo_effects", "file_batches", "files", "file_chunks", "file_vectors"}
# Where an older Conveyor left each migration branch: the platform, the demo, the files.
LEGACY_HEADS = ["0010", "d001", "f003"]
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@contextlib.contextmanager
def postgres(schema: str = "conveyor") -> Iterator[tuple[str, Engine]]:
    with scratch_database("conveyor_ns") as url:
        engine = make_engine(url, pool_size=2, schema=schema)
        try:
            yield url, engine
        finally:
            engine.dispose()


def tables_in(engine: Engine, schema: str) -> set[str]:
    return set(inspect(engine).get_table_names(schema=schema))


def an_app_of_its_own(engine: Engine) -> None:
    """An app that was there first: its own ``jobs`` and its own Alembic history."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.jobs (id serial PRIMARY KEY, title text NOT NULL)"))
        conn.execute(text("INSERT INTO public.jobs (title) VALUES ('plumber')"))
        conn.execute(text("CREATE TABLE public.alembic_version (version_num varchar(32) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO public.alembic_version VALUES ('app_0007')"))


def test_beside_an_app_everything_goes_into_the_conveyor_schema(platform: Any, worker: Any) -> None:
    with postgres() as (url, engine):
        an_app_of_its_own(engine)
        upgrade(engine)
        assert OURS | {"alembic_version", "tokens", "file_chunk_staging"} <= tables_in(engine, "conveyor")
        assert tables_in(engine, "public") == {"jobs", "alembic_version"}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM public.alembic_version")).scalars().all() == [
                "app_0007"
            ]
            heads = set(conn.execute(text("SELECT version_num FROM conveyor.alembic_version")).scalars())
            assert {"0019", "d002", "f005"} <= heads
            functions = conn.execute(
                text("SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
            ).scalars()
            assert not [f for f in functions if f.startswith(("conveyor_", "file_chunk_"))]
        # The app's own engine (no search_path of ours) and its session: the job joins the
        # app's transaction, lands in conveyor.jobs, and a worker runs it.
        app_engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with bound_to(platform, url):
                registry.write(platform.engine, platform.stages.values())
                with Session(app_engine) as session:
                    session.execute(text("INSERT INTO jobs (title) VALUES ('welder')"))
                    job = platform.submit("conveyor.demo.square", {"n": 6}, session=session)
                    session.commit()
                assert job.wait(30) == s.SUCCEEDED and job.result == {"n": 36}
            with app_engine.connect() as conn:
                assert conn.execute(text("SELECT count(*) FROM public.jobs")).scalar_one() == 2
                status = conn.execute(text("SELECT status FROM conveyor.jobs WHERE id = :i"), {"i": job.id})
                assert status.scalar_one() == s.SUCCEEDED
        finally:
            app_engine.dispose()


def legacy_postgres(url: str) -> Engine:
    """The layout an older Conveyor left: every table, the sequence, the functions and the
    version table in ``public``."""
    old = make_engine(url, pool_size=2, schema="public")
    for head in LEGACY_HEADS:
        command.upgrade(alembic_config(old, FAMILY_MIGRATIONS), head)
    return old


def a_queued_job(engine: Engine, job_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            s.jobs.insert().values(
                id=job_id, stage="conveyor.demo.square", queue="default", status=s.QUEUED, priority=0,
                payload={"n": 4}, options={}, max_attempts=3, attempts=0, uncounted=0, requeues=0,
                run_at=NOW, created_at=NOW, updated_at=NOW,
            )
        )  # fmt: skip


def test_a_postgres_database_of_an_older_conveyor_moves_with_its_data() -> None:
    with scratch_database("conveyor_ns") as url:
        old = legacy_postgres(url)
        try:
            assert tables_in(old, "public") >= OURS
            job_id = str(uuid.uuid4())
            a_queued_job(old, job_id)
            with old.begin() as conn:
                conn.execute(text("SELECT setval('public.conveyor_seq', 41)"))
                conn.execute(text("INSERT INTO public.alembic_version VALUES ('app_0007')"))  # shared
        finally:
            old.dispose()
        engine = make_engine(url, pool_size=2)
        try:
            upgrade(engine)
            assert OURS | {"alembic_version"} <= tables_in(engine, "conveyor")
            assert tables_in(engine, "public") == {"alembic_version"}  # the app's history stays
            with engine.connect() as conn:
                assert (
                    conn.execute(text("SELECT version_num FROM public.alembic_version")).scalar_one()
                    == "app_0007"
                )
                assert conn.execute(text("SELECT nextval('conveyor.conveyor_seq')")).scalar_one() == 42
                claimed = conn.execute(
                    text("SELECT id, status FROM conveyor.conveyor_claim(:i, 'w1', 't1')"), {"i": job_id}
                ).one()
                assert tuple(claimed) == (job_id, s.RUNNING)
            upgrade(engine)  # a second upgrade is a no-op
            assert tables_in(engine, "public") == {"alembic_version"}
        finally:
            engine.dispose()


def test_an_sqlite_database_of_an_older_conveyor_takes_the_prefix(tmp_path: Path) -> None:
    engine = make_engine(sqlite_url(tmp_path))
    try:
        for head in LEGACY_HEADS:
            command.upgrade(alembic_config(engine, FAMILY_MIGRATIONS), head)
        with engine.begin() as conn:  # as an older Conveyor named its version table
            conn.execute(text("ALTER TABLE conveyor_alembic_version RENAME TO alembic_version"))
            conn.execute(
                text(
                    "INSERT INTO files (id, owner, name, size, content_ref, checksum, status, created_at,"
                    " updated_at) VALUES ('f1', 'alice', 'light.txt', 1, '-', '-', 'ready', 0, 0)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO file_chunks (file_id, owner, ordinal, text)"
                    " VALUES ('f1', 'alice', 0, 'the Fresnel lens bends light')"
                )
            )
        upgrade(engine)
        names = set(inspect(engine).get_table_names())
        assert {f"conveyor_{t}" for t in OURS - {"conveyor_counters"}} | {"conveyor_alembic_version"} <= names
        assert "conveyor_file_chunk_staging" in names and "file_chunk_staging" not in names
        assert not names & (OURS - {"conveyor_counters"}) and "alembic_version" not in names
        with engine.connect() as conn:
            hits = lexical(conn, "alice", "fresnel")  # the FTS index, rebuilt under its new name
            assert [h.file_id for h in hits.ranked] == ["f1"]
    finally:
        engine.dispose()


def test_a_schema_of_the_callers_choosing(platform: Any) -> None:
    with postgres(schema="tenant_jobs") as (url, engine):
        upgrade(engine)
        assert tables_in(engine, "tenant_jobs") >= OURS
        assert not tables_in(engine, "conveyor") and not tables_in(engine, "public")
        registry.write(engine, platform.stages.values())
        settings = ConveyorSettings(db_schema="tenant_jobs").with_urls(platform.settings.redis_url, url)
        client = conveyor.connect(settings)
        app_engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            direct = client.submit("conveyor.demo.square", {"n": 2})
            with Session(app_engine) as session:
                in_session = client.submit("conveyor.demo.square", {"n": 3}, session=session)
                session.commit()
            with app_engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT id FROM tenant_jobs.jobs WHERE id IN (:a, :b)"),
                    {"a": direct.id, "b": in_session.id},
                )
                assert len(rows.all()) == 2
            eventually(lambda: client.job(in_session.id).status() == s.QUEUED)
        finally:
            client.close()
            app_engine.dispose()


def test_a_schema_name_is_an_identifier() -> None:
    with pytest.raises(ValueError, match="lower-case identifier"):
        ConveyorSettings(db_schema='x"; DROP TABLE jobs; --')


def test_each_deployment_upgrades_the_branches_it_has(tmp_path: Path) -> None:
    """A second deployment (or an app with the client only) on the same database has other
    migration branches: its upgrade leaves this one's revisions as they are, and a database
    a newer Conveyor migrated is refused instead of migrated again from scratch."""
    engine = make_engine(sqlite_url(tmp_path))
    try:
        upgrade(engine)  # this deployment: the platform, the demo and the files branches
        with engine.connect() as conn:
            before = set(conn.execute(text("SELECT version_num FROM conveyor_alembic_version")).scalars())
        platform_upgrade(engine)  # only the platform's branch: d002 and f005 are not known here
        with engine.connect() as conn:
            after = set(conn.execute(text("SELECT version_num FROM conveyor_alembic_version")).scalars())
        assert after == before and {"d002", "f005"} <= after
        with engine.begin() as conn:  # as if a newer Conveyor had added its 0099
            conn.execute(
                text(
                    "UPDATE conveyor_alembic_version SET version_num = '0099' "
                    "WHERE version_num GLOB '00[0-9][0-9]'"  # the platform's head, whichever it is
                )
            )
        with pytest.raises(ConfigurationError, match="newer Conveyor"):
            platform_upgrade(engine)
    finally:
        engine.dispose()


def test_on_sqlite_dedup_and_the_relays_purge_find_the_prefixed_tables(on_sqlite: Any, tag: str) -> None:
    """Statements that name a table in their text (an ON CONFLICT clause, a correlated
    delete) must use the prefixed name SQLite has."""
    first = on_sqlite.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-1"})
    again = on_sqlite.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-2"})
    assert again.id == first.id and again.deduplicated
    relay = on_sqlite.relay()
    for _ in range(2):  # the second pass reconciles (and purges) as a running relay does
        report = relay.tick()
        assert not report.skipped_busy
