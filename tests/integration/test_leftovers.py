"""The suite's own isolation: what a test leaves unfinished is cancelled when it ends
(``tests.helpers.cancelling_leftovers``, used by the ``spawn`` and ``hosts`` fixtures), and
nothing else is touched. No worker: the jobs' rows are put in each state directly."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, update

from conveyor.store.db import schema as s
from tests.helpers import cancelling_leftovers, job_row

pytestmark = pytest.mark.timeout(60)


def _put(platform: Any, job_id: str, **values: Any) -> None:
    with platform.engine.begin() as conn:
        conn.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(**values))


def test_a_tests_unfinished_jobs_are_cancelled_and_nothing_else(platform: Any, tag: str) -> None:
    square = "conveyor.demo.square"
    earlier = platform.submit(square, {"n": 1}).id  # submitted before: not this test's
    with cancelling_leftovers(platform):
        queued = platform.submit(square, {"n": 2}).id
        running = platform.submit(square, {"n": 3}).id  # on a worker that was then killed
        _put(platform, running, status=s.RUNNING, attempts=1, lease_owner=f"{tag}-gone:1")
        done = platform.submit(square, {"n": 4}).id
        _put(platform, done, status=s.SUCCEEDED, attempts=1)
    try:
        assert job_row(platform, queued)["status"] == s.CANCELLED
        stopping = job_row(platform, running)
        # A running job is asked to stop: it ends cancelled at its takeover's claim.
        assert stopping["status"] == s.RUNNING and stopping["cancel_requested_at"] is not None
        assert stopping["cancelled_by"] == "tests"
        finished = job_row(platform, done)
        assert finished["status"] == s.SUCCEEDED and finished["cancel_requested_at"] is None
        assert job_row(platform, earlier)["status"] == s.QUEUED
    finally:
        platform.cancel(earlier)
        _put(platform, running, status=s.CANCELLED, finished_at=func.now())  # its worker is gone
