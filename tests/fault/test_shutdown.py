"""Stopping is not failing: a bounded SIGTERM and a job the worker itself cut short are
requeued uncounted, and only crashes count."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from conveyor.db import schema as s
from conveyor.store import counted_attempts
from tests.fault.conftest import Spawn
from tests.helpers import effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


def started(platform: Any, barrier: str, n: int = 1, timeout: float = 60) -> list[str]:
    """``job:attempt:pid`` of the first ``n`` bodies that reached ``barrier``."""
    r = platform.redis
    return eventually(
        lambda: (lambda v: [x.decode() for x in v] if len(v) >= n else None)(
            r.lrange(f"{barrier}:started", 0, -1)
        ),
        timeout,
    )


def open_barrier(platform: Any, barrier: str, n: int = 10) -> None:
    """Let ``n`` bodies waiting at ``barrier`` through."""
    platform.redis.rpush(f"{barrier}:go", *["go"] * n)


def test_sigterm_cuts_a_long_job_short_at_the_deadline_uncounted(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    worker = spawn(env={"CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "2"})
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    started(platform, tag)
    sent = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert time.monotonic() - sent < 10  # the deadline (2 s) bounded it, not the job
    row = handle.row()
    assert row["status"] == s.QUEUED and row["uncounted"] == 1 and row["requeues"] == 1
    requeued = [e.body for e in handle.events()[0] if e.topic == "job.requeued"]
    assert requeued and requeued[0]["reason"] == "shutdown"
    open_barrier(platform, tag)
    spawn()
    assert handle.wait(60) == s.SUCCEEDED
    row = handle.row()
    assert counted_attempts(row) == 1 and row["attempts"] == 2
    assert effect_count(platform, note=tag) == 1


def test_sigterm_lets_a_job_finish_within_the_deadline(platform: Any, spawn: Spawn, tag: str) -> None:
    worker = spawn(env={"CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "20"})
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    started(platform, tag)
    worker.send_signal(signal.SIGTERM)
    time.sleep(1)
    open_barrier(platform, tag)
    assert worker.wait(timeout=30) == 0
    assert handle.wait(10) == s.SUCCEEDED
    assert handle.row()["attempts"] == 1 and handle.row()["uncounted"] == 0
    assert effect_count(platform, note=tag) == 1


def test_job_terminated_by_its_own_worker_is_requeued_uncounted(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    """What a cold shutdown, or Celery cancelling jobs on a broker connection loss, does to
    a running job: SIGTERM into its pool child. Not the job's failure."""
    spawn()
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    _, attempt, pid = started(platform, tag)[0].split(":")
    assert attempt == "1"
    os.kill(int(pid), signal.SIGTERM)
    eventually(lambda: job_row(platform, handle.id)["attempts"] == 2, timeout=60)
    open_barrier(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    row = handle.row()
    assert counted_attempts(row) == 1 and row["uncounted"] == 1
    topics = [e.topic for e in handle.events()[0]]
    assert "job.requeued" in topics and "job.retrying" not in topics and "job.stalled" not in topics
    assert effect_count(platform, note=tag) == 1
