"""Shared test helpers (importable by tests; workers never import this)."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from sqlalchemy import delete, func, select

from conveyor.store.db.schema import TERMINAL, dead_letters, jobs, stages
from tasks.demo.models import effects


def eventually(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {value!r})")


def job_row(platform: Any, job_id: str) -> Any:
    """The current row of a job."""
    with platform.engine.connect() as conn:
        return platform.store.get(conn, job_id)


def database_now(platform: Any) -> dt.datetime:
    """The database's clock."""
    from conveyor.store.db.dialect import db_now

    with platform.engine.connect() as conn:
        return conn.execute(select(db_now())).scalar_one()  # type: ignore[no-any-return]


@contextlib.contextmanager
def cancelling_leftovers(platform: Any) -> Iterator[None]:
    """Cancel, on the way out, every job submitted inside that has not ended: a test that
    fails half way leaves its long jobs behind, and the next module's worker would take
    them over and run them instead of its own test's jobs."""
    since = database_now(platform)
    try:
        yield
    finally:
        with platform.engine.connect() as conn:
            left = (
                conn.execute(
                    select(jobs.c.id).where(jobs.c.created_at >= since, jobs.c.status.not_in(TERMINAL))
                )
                .scalars()
                .all()
            )
        for job_id in left:
            with contextlib.suppress(LookupError):  # purged meanwhile
                platform.cancel(job_id, by="tests", reason="its test ended")


@contextlib.contextmanager
def module_stages(platform: Any, prefix: str, declared: Mapping[str, Any]) -> Iterator[SimpleNamespace]:
    """Stages a test module declares for itself (their names under ``prefix``), removed
    afterwards with their registry rows: the registry tests of the same session expect the
    deployment's stages alone."""
    try:
        yield SimpleNamespace(**declared)
    finally:
        for task in declared.values():
            platform.stages.pop(task.name, None)
            platform.app.tasks.pop(task.name, None)
        with platform.engine.begin() as conn:
            conn.execute(delete(stages).where(stages.c.name.like(f"{prefix}%")))


def effect_count(platform: Any, *, job_id: str | None = None, note: str | None = None) -> int:
    """How many effect rows exist for a job or note (no unique constraint: duplicates show)."""
    q = select(func.count()).select_from(effects)
    if job_id is not None:
        q = q.where(effects.c.job_id == job_id)
    if note is not None:
        q = q.where(effects.c.note == note)
    with platform.engine.connect() as conn:
        return int(conn.execute(q).scalar_one())


def dead_letter_for(platform: Any, job_id: str) -> Any:
    """The newest DLQ entry of a job."""
    with platform.engine.connect() as conn:
        return (
            conn.execute(
                select(dead_letters).where(dead_letters.c.job_id == job_id).order_by(dead_letters.c.id.desc())
            )
            .mappings()
            .first()
        )


def jobs_of_flow(platform: Any, flow_id: str) -> list[Any]:
    """Every job of a flow, oldest first."""
    with platform.engine.connect() as conn:
        return list(
            conn.execute(select(jobs).where(jobs.c.flow_id == flow_id).order_by(jobs.c.created_at)).mappings()
        )


def publish_again(platform: Any, row: Any, *, task_id: str) -> None:
    """The same message as ``row``'s again: a duplicate delivery, made on purpose."""
    platform.broker.publish(
        stage=row["stage"],
        job_id=row["id"],
        queue=row["queue"],
        payload=row["payload"],
        options=row["options"],
        task_id=task_id,
    )


def discarded(platform: Any, job_id: str) -> list[str]:
    """Why copies of ``job_id`` were discarded unrun (the runner notes them in Redis only)."""
    out = []
    for _, fields in platform.redis.xrange(platform.discarded_stream):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f.get("job") == job_id:
            out.append(f["reason"])
    return out


@contextlib.contextmanager
def scratch_database(prefix: str = "conveyor_scratch") -> Iterator[str]:
    """An empty Postgres database of its own, dropped afterwards (even with connections
    still open); yields its URL."""
    import psycopg

    from tests.conftest import PG_BASE

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_BASE}/{name}"
    finally:
        with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def scratch_redis() -> Iterator[str]:
    """A Redis DB no test session holds (the locks of tests/conftest.py), flushed before and
    after, for a process whose messages no test's worker may receive; yields its URL."""
    import redis

    from tests.conftest import REDIS_BASE, lock_free_redis_db

    db, fd = lock_free_redis_db()
    url = f"{REDIS_BASE}/{db}"
    conn = redis.Redis.from_url(url)
    try:
        conn.flushdb()
        yield url
    finally:
        conn.flushdb()
        conn.close()
        os.close(fd)  # and with it the lock


@contextlib.contextmanager
def bound_to(platform: Any, database_url: str, *, redis_url: str | None = None) -> Iterator[Any]:
    """The test platform on another database (and ``redis_url``, else the same Redis), then back."""
    redis_before, before = platform.settings.redis_url, platform.settings.database_url
    broker_url = platform.settings.broker_url
    platform.bind(redis_url=redis_url or redis_before, database_url=database_url, broker_url=broker_url)
    try:
        yield platform
    finally:
        platform.bind(redis_url=redis_before, database_url=before, broker_url=broker_url)
