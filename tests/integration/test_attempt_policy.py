"""Attempts keep their promises: a failing query is counted and bounded, a lost connection
is not counted but bounded too, and a fenced-off attempt's late failure writes nothing."""

from __future__ import annotations

import itertools
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import select, update
from sqlalchemy.pool import NullPool

from conveyor.errors import is_connection_loss, is_own_outage, is_permanent
from conveyor.runfile import owner_id
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from conveyor.store.db.schema import job_events, jobs
from conveyor.store.jobs import ClaimOutcome, NewJob, counted_attempts
from tests.helpers import dead_letter_for

pytestmark = pytest.mark.timeout(120)


def _topics(handle: Any) -> list[str]:
    return [e.topic for e in handle.events()[0]]


def test_statement_timeout_in_a_body_is_counted_and_dead_letters(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.query", {"kind": "statement_timeout"})
    assert handle.wait(60) == s.DEAD
    row = handle.row()
    assert counted_attempts(row) == row["max_attempts"] == 2
    assert row["uncounted"] == 0 and row["attempts"] == 2
    topics = _topics(handle)
    assert topics.count("job.retrying") == 1 and "job.requeued" not in topics
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "OperationalError"
    assert "gave up after 2 of 2 attempts" in letter["message"]
    assert "canceling statement due to statement timeout" in letter["message"]
    assert "[SQL:" not in letter["message"]  # a person reads this: no statement text


@pytest.mark.parametrize(("kind", "error"), [("syntax", "ProgrammingError"), ("data", "DataError")])
def test_query_the_database_rejects_is_permanent(platform: Any, worker: Any, kind: str, error: str) -> None:
    handle = platform.submit("conveyor.demo.query", {"kind": kind})
    assert handle.wait(60) == s.DEAD
    assert handle.row()["attempts"] == 1
    assert dead_letter_for(platform, handle.id)["error_type"] == error


@pytest.fixture
def few_requeues(platform: Any) -> Iterator[int]:
    before = platform.store.max_requeues
    platform.store.max_requeues = 3
    yield 3
    platform.store.max_requeues = before


@pytest.mark.parametrize(
    ("kind", "error", "first_line"),
    [
        ("nul", "DataError", "PostgreSQL text fields cannot contain NUL (0x00) bytes"),
        ("params", "ProgrammingError", "the query has 1 placeholders but 2 parameters were passed"),
        ("unique", "IntegrityError", "unique_violation"),
    ],
)
def test_statement_errors_the_driver_raises_are_permanent(
    platform: Any, worker: Any, few_requeues: int, kind: str, error: str, first_line: str
) -> None:
    """psycopg refuses a NUL byte or a wrong parameter count itself (sqlstate None): that
    is the statement's error, not a lost connection; it dead-letters at once, naming it."""
    handle = platform.submit("conveyor.demo.query", {"kind": kind})
    assert handle.wait(60) == s.DEAD
    row = handle.row()
    assert row["attempts"] == 1 and row["uncounted"] == row["requeues"] == 0
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == error
    message = letter["message"]  # the driver's first line, never the statement
    assert message.startswith("database error (") and first_line in message and "SELECT" not in message


DOWN_POSTGRES = "postgresql://postgres@127.0.0.1:1/gone"


@pytest.mark.parametrize(
    ("kind", "url", "error"),
    [
        ("downstream_sqlalchemy", DOWN_POSTGRES.replace("://", "+psycopg://"), "OperationalError"),
        ("downstream_psycopg", DOWN_POSTGRES, "OperationalError"),
        ("downstream_redis", "redis://127.0.0.1:1/0", "ConnectionError"),
    ],
)
def test_an_outage_of_the_bodys_own_server_counts_and_follows_the_schedule(
    platform: Any, worker: Any, few_requeues: int, kind: str, url: str, error: str
) -> None:
    """A server the body itself connects to is down: the body's error, however it connects
    (Conveyor's own Postgres and Redis answer meanwhile). Counted, retried on the stage's
    Schedule (0.2 s first), never requeued uncounted."""
    handle = platform.submit("conveyor.demo.query", {"kind": kind, "url": url})
    assert handle.wait(60) == s.DEAD
    row = handle.row()
    assert counted_attempts(row) == row["attempts"] == 2 and row["uncounted"] == row["requeues"] == 0
    events = handle.events()[0]
    retrying = [e.body for e in events if e.topic == "job.retrying"]
    assert [r["delay"] for r in retrying] == [0.2] and retrying[0]["error_type"] == error
    assert "job.requeued" not in [e.topic for e in events]
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == error and "gave up after 2 of 2 attempts" in letter["message"]


def test_lost_connection_is_uncounted_but_bounded(platform: Any, worker: Any, few_requeues: int) -> None:
    handle = platform.submit("conveyor.demo.query", {"kind": "disconnect"})
    assert handle.wait(90) == s.DEAD
    row = handle.row()
    assert row["requeues"] == row["uncounted"] == few_requeues
    assert counted_attempts(row) <= row["max_attempts"]
    assert _topics(handle).count("job.requeued") == few_requeues
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "RequeuesExhausted"
    assert "infrastructure kept failing" in letter["message"]


@pytest.fixture
def requeue_backoff(platform: Any) -> Iterator[None]:
    store = platform.store
    before = (store.requeue_backoff, store.requeue_backoff_cap)
    store.requeue_backoff, store.requeue_backoff_cap = 0.2, 0.5
    yield
    store.requeue_backoff, store.requeue_backoff_cap = before


def test_uncounted_requeues_back_off_growing_to_a_cap(
    platform: Any, worker: Any, few_requeues: int, requeue_backoff: None
) -> None:
    """Each requeue after a lost connection of Conveyor's own database waits twice the
    last (0.2, 0.4, then the 0.5 cap) in the job's ``run_at``: a flapping database cannot
    burn CONVEYOR_MAX_REQUEUES in seconds."""
    handle = platform.submit("conveyor.demo.query", {"kind": "disconnect"})
    assert handle.wait(90) == s.DEAD
    with platform.engine.connect() as conn:
        requeued = conn.execute(
            select(job_events.c.body, job_events.c.created_at)
            .where(job_events.c.job_id == handle.id, job_events.c.topic == "job.requeued")
            .order_by(job_events.c.id)
        ).all()
    assert [r.body["delay"] for r in requeued] == [0.2, 0.4, 0.5]
    for before, after in itertools.pairwise(requeued):  # the next attempt waited its delay
        assert (after.created_at - before.created_at).total_seconds() >= before.body["delay"] - 0.01
    assert dead_letter_for(platform, handle.id)["error_type"] == "RequeuesExhausted"


def test_an_attempt_retaken_by_its_own_process_waits_its_backoff(platform: Any) -> None:
    """The message of an attempt an outage cut short came back to its own process before
    the deferred release did: the claim releases it uncounted with the back-off instead
    of running it at once."""
    store = platform.store
    before = (store.requeue_backoff, store.requeue_backoff_cap)
    store.requeue_backoff, store.requeue_backoff_cap = 30.0, 60.0
    try:
        with platform.engine.begin() as conn:
            job_id, _ = store.insert(
                conn, NewJob(stage="conveyor.demo.flaky", queue="demo", payload={"n": 1}, max_attempts=3)
            )
            assert store.claim(conn, job_id, owner=owner_id(), task_id="a").outcome is ClaimOutcome.RUN
            again = store.claim(conn, job_id, owner=owner_id(), task_id="b")
            wait = conn.execute(select(jobs.c.run_at - sa.func.now()).where(jobs.c.id == job_id)).scalar_one()
    finally:
        store.requeue_backoff, store.requeue_backoff_cap = before
    handle = platform.job(job_id)
    handle.cancel()
    assert again.outcome is ClaimOutcome.NOT_DUE
    row = handle.row()
    assert row["attempts"] == 1 and row["uncounted"] == row["requeues"] == 1
    assert 29 <= wait.total_seconds() <= 31
    assert [e.body for e in handle.events()[0] if e.topic == "job.requeued"] == [
        {"reason": "infrastructure", "attempt": 1, "delay": 30.0}
    ]


def test_a_lost_connection_then_success_counts_one_attempt(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.query", {"kind": "disconnect", "fail_until_attempt": 1})
    assert handle.wait(60) == s.SUCCEEDED
    row = handle.row()
    assert row["attempts"] == 2 and row["uncounted"] == 1 and counted_attempts(row) == 1


def test_fenced_off_attempts_late_failure_writes_nothing(platform: Any) -> None:
    store = platform.store
    spec = platform.stages["conveyor.demo.flaky"]
    with platform.engine.begin() as conn:
        job_id, _ = store.insert(
            conn, NewJob(stage=spec.name, queue="demo", payload={"n": 1}, max_attempts=3)
        )
        # The first attempt's owner is a process of this host that has exited: taken over.
        gone = subprocess.Popen(["true"])
        gone.wait()
        first = store.claim(conn, job_id, owner=owner_id(gone.pid), task_id="a").job
        second = store.claim(conn, job_id, owner=owner_id(), task_id="b").job
    assert first is not None and second is not None and second["attempts"] == 2
    from celery.exceptions import Ignore

    with pytest.raises(Ignore):
        platform.completion.fail(None, spec, first, 1, RuntimeError("late failure of attempt 1"))
    handle = platform.job(job_id)
    row = handle.row()
    assert row["status"] == s.RUNNING and row["attempts"] == 2 and row["error_type"] is None
    assert "job.retrying" not in _topics(handle)
    with platform.engine.begin() as conn:  # the same for a late dead-letter
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(max_attempts=1))
        first = dict(first) | {"max_attempts": 1}
    with pytest.raises(Ignore):
        platform.completion.fail(None, spec, first, 1, RuntimeError("late failure of attempt 1"))
    assert handle.row()["status"] == s.RUNNING and dead_letter_for(platform, job_id) is None


# -- the classification, against real errors of real connections ---------------------------


def _pg_error(platform: Any, sql: str) -> BaseException:
    with platform.engine.connect() as conn:
        try:
            conn.exec_driver_sql(sql)
        except sa.exc.DBAPIError as exc:
            return exc
    raise AssertionError("no error")


def test_classification_of_real_database_errors(platform: Any, tmp_path: Path) -> None:
    timeout = _pg_error(platform, "SET LOCAL statement_timeout = 20; SELECT pg_sleep(1)")
    terminated = _pg_error(platform, "SELECT pg_terminate_backend(pg_backend_pid())")
    syntax = _pg_error(platform, "SELEC 1")
    assert not is_connection_loss(timeout) and not is_permanent(timeout)
    assert is_connection_loss(terminated)
    assert is_permanent(syntax) and not is_connection_loss(syntax)
    refused = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:1/x")
    with pytest.raises(sa.exc.DBAPIError) as caught:
        refused.connect()
    assert is_connection_loss(caught.value)
    assert is_connection_loss(redis.ConnectionError("Connection refused"))
    lite = sa.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with lite.connect() as conn, pytest.raises(sa.exc.DBAPIError) as missing:
        conn.exec_driver_sql("SELECT * FROM no_such_table")
    assert not is_connection_loss(missing.value)  # a bug or a missing migration: counted
    locked = sa.exc.OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked"))
    assert is_connection_loss(locked)


def test_only_conveyors_own_engine_and_redis_vouch_for_an_outage(platform: Any) -> None:
    """A lost connection is an outage of Conveyor's (uncounted) only when Conveyor's own
    engine saw it, or, for Redis, when Conveyor's own Redis does not answer either; a
    statement psycopg refuses itself (sqlstate None) is no lost connection at all."""
    terminated = _pg_error(platform, "SELECT pg_terminate_backend(pg_backend_pid())")
    assert is_own_outage(terminated, redis_answers=lambda: True)
    body_engine = sa.create_engine(platform.engine.url, poolclass=NullPool)  # the body's own
    with body_engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as theirs:
        conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")
    assert is_connection_loss(theirs.value) and not is_own_outage(theirs.value, redis_answers=lambda: False)
    down = "postgresql+psycopg://postgres@127.0.0.1:1/gone"
    with pytest.raises(sa.exc.DBAPIError) as refused_theirs:
        sa.create_engine(down, poolclass=NullPool).connect()
    assert not is_own_outage(refused_theirs.value, redis_answers=lambda: True)
    with pytest.raises(sa.exc.DBAPIError) as refused_own:
        make_engine(down, pool_size=0).connect()
    assert is_own_outage(refused_own.value, redis_answers=lambda: True)
    lost_redis = redis.ConnectionError("Connection refused")
    assert not is_own_outage(lost_redis, redis_answers=lambda: True)  # the body's Redis
    assert is_own_outage(lost_redis, redis_answers=lambda: False)  # Conveyor's is down too
    with platform.engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as nul:
        conn.exec_driver_sql("SELECT %s::text", ("a\x00b",))
    assert nul.value.orig.sqlstate is None and not is_connection_loss(nul.value) and is_permanent(nul.value)
    assert not is_own_outage(nul.value, redis_answers=lambda: False)
