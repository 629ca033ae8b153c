"""Payload size limits on every path that creates a job, and whose clock a time uses."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from celery import chain
from sqlalchemy import func, select

import tasks.demo as demo
from conveyor.errors import PayloadTooLarge
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from tests.helpers import dead_letter_for, eventually, job_row

pytestmark = pytest.mark.timeout(120)

LIMIT = 65536


def _count_label(platform: Any, label: str) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(jobs.c.label == label)).scalar_one())


def test_oversized_submit_is_refused_naming_size_and_limit(platform: Any) -> None:
    with pytest.raises(PayloadTooLarge, match=rf"is 656\d\d bytes of JSON, over the limit of {LIMIT} bytes"):
        platform.submit("conveyor.demo.pad", {"pad": "x" * (LIMIT + 100)})
    with pytest.raises(PayloadTooLarge):
        demo.pad.delay(pad="y" * (LIMIT + 100))
    assert platform.settings.max_payload_bytes == LIMIT


def test_payload_at_the_limit_is_accepted(platform: Any) -> None:
    handle = platform.submit("conveyor.demo.pad", {"pad": "x" * (LIMIT - 100)}, delay=3600)
    assert handle.status() == s.QUEUED
    platform.cancel(handle.id)


def test_oversized_plain_celery_message_is_dead_lettered_at_adoption(platform: Any, worker: Any) -> None:
    result = platform.app.send_task("conveyor.demo.pad", kwargs={"pad": "z" * (LIMIT + 1)}, queue="demo")

    def adopted() -> Any:
        with platform.engine.connect() as conn:
            return conn.execute(select(jobs).where(jobs.c.origin_task_id == result.id)).mappings().first()

    row = eventually(lambda: (r := adopted()) is not None and r["status"] == s.DEAD and r, timeout=30)
    letter = dead_letter_for(platform, row["id"])
    assert letter["error_type"] == "PayloadTooLarge"
    assert f"limit of {LIMIT} bytes" in letter["message"]
    assert row["payload"] == {}  # the blob is not kept


def test_oversized_next_link_is_dead_lettered_and_the_parent_succeeds(platform: Any, worker: Any) -> None:
    flow = chain(demo.pad.si(n=LIMIT + 500), demo.pad.s()).apply_async()
    parent = platform.job(flow.parent.id)
    assert parent.wait(30) == s.SUCCEEDED
    link = eventually(lambda: job_row(platform, flow.id), timeout=30)
    assert link["status"] == s.DEAD and link["payload"] == {}
    letter = dead_letter_for(platform, flow.id)
    assert letter["error_type"] == "PayloadTooLarge"
    assert f"limit of {LIMIT} bytes" in letter["message"] and "conveyor.demo.pad" in letter["message"]
    assert parent.status() == s.SUCCEEDED
    with pytest.raises(PayloadTooLarge, match=f"limit of {LIMIT} bytes"):
        flow.get(timeout=10)  # a Celery caller hears of it, as of a task that raised


def test_absolute_times_are_stored_as_given(platform: Any) -> None:
    run_at = dt.datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    handle = platform.submit("conveyor.demo.noop", {"n": 1}, run_at=run_at)
    assert handle.row()["run_at"] == run_at
    eta = dt.datetime(2031, 2, 3, 4, 5, 6, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    expires = dt.datetime(2031, 3, 1, 0, 0, 0, 1, tzinfo=dt.UTC)
    result = demo.noop.apply_async(kwargs={"n": 2}, eta=eta, expires=expires)
    row = job_row(platform, result.job.id)
    assert row["run_at"] == eta and row["expires_at"] == expires
    assert row["published_at"] is None  # the relay publishes it when the database says it is due
    naive = dt.datetime(2031, 4, 1, 12, 0, 0, 42)
    row = platform.submit("conveyor.demo.noop", {"n": 3}, run_at=naive).row()
    assert row["run_at"] == naive.replace(tzinfo=dt.UTC)
    for h in (handle.id, result.job.id, row["id"]):
        platform.cancel(h)


def _about(delta: dt.timedelta, seconds: float) -> bool:
    # Both ends are read from the database's clock in one statement, microseconds apart.
    return abs(delta.total_seconds() - seconds) < 0.005


def test_relative_times_count_on_the_database_clock(platform: Any) -> None:
    handle = platform.submit("conveyor.demo.noop", {"n": 1}, delay=120.5, expires_in=300.25)
    row = handle.row()
    assert _about(row["run_at"] - row["created_at"], 120.5)
    assert _about(row["expires_at"] - row["created_at"], 300.25)
    result = demo.noop.apply_async(kwargs={"n": 2}, countdown=90.25, expires=200)
    row = job_row(platform, result.job.id)
    assert _about(row["run_at"] - row["created_at"], 90.25)
    assert _about(row["expires_at"] - row["created_at"], 200)
    platform.cancel(handle.id)
    platform.cancel(result.job.id)


def test_due_absolute_run_at_runs_promptly(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.noop", {"n": 1}, run_at=dt.datetime.now(dt.UTC))
    assert handle.wait(15) == s.SUCCEEDED
