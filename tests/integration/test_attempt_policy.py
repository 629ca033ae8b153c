"""Attempts keep their promises: a failing query is counted and bounded, a lost connection
is not counted but bounded too, and a fenced-off attempt's late failure writes nothing."""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import update

from conveyor.db import schema as s
from conveyor.db.schema import jobs
from conveyor.errors import is_connection_loss, is_permanent
from conveyor.runfile import owner_id
from conveyor.store import NewJob, counted_attempts
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
