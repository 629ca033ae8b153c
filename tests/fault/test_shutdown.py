"""Stopping is not failing: a bounded SIGTERM and a job the worker itself cut short are
requeued uncounted, and only crashes count."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conveyor.store.db import schema as s
from conveyor.store.jobs import counted_attempts
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


def _requeued_for_shutdown(platform: Any, job_id: str) -> bool:
    handle = platform.job(job_id)
    row = handle.row()
    reasons = [e.body.get("reason") for e in handle.events()[0] if e.topic == "job.requeued"]
    return bool(row["status"] == s.QUEUED and row["uncounted"] == 1 and reasons == ["shutdown"])


def test_sigterm_deadline_requeues_a_send_task_job_too(platform: Any, spawn: Spawn, tag: str) -> None:
    """A job adopted from a plain Celery message (no job header) is requeued uncounted at
    the deadline like a submitted one, not left running and killed."""
    worker = spawn(env={"CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "2"})
    submitted = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    sent = platform.app.send_task(
        "conveyor.demo.effect", kwargs={"note": f"{tag}-sent", "barrier": tag}, queue="demo"
    )
    assert {x.split(":")[0] for x in started(platform, tag, n=2)} == {submitted.id, sent.id}
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert _requeued_for_shutdown(platform, submitted.id)
    assert _requeued_for_shutdown(platform, sent.id), job_row(platform, sent.id)


def test_sigterm_to_the_process_group_keeps_the_grace(
    platform: Any, spawn: Spawn, tag: str, tmp_path: Path
) -> None:
    """honcho and systemd signal every process of the worker's group: the pool children do
    not die at once; a job that ends within the deadline finishes, the rest are requeued
    uncounted at it, as with SIGTERM to the main process alone."""
    worker = spawn(env={"CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "5"})
    quick = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": f"{tag}-q"})
    stuck = platform.submit("conveyor.demo.effect", {"note": f"{tag}-s", "barrier": f"{tag}-s"})
    started(platform, f"{tag}-q")
    started(platform, f"{tag}-s")
    sent = time.monotonic()
    os.killpg(worker.pid, signal.SIGTERM)
    # The main process took it as a warm shutdown (the children got theirs at the same time).
    eventually(lambda: "Warm shutdown" in (tmp_path / "worker-0.log").read_text(), timeout=30)
    open_barrier(platform, f"{tag}-q")
    assert worker.wait(timeout=30) == 0
    assert time.monotonic() - sent >= 3  # the deadline ended it, not the signal
    assert quick.wait(10) == s.SUCCEEDED
    assert quick.row()["attempts"] == 1 and quick.row()["uncounted"] == 0
    assert effect_count(platform, note=tag) == 1
    assert _requeued_for_shutdown(platform, stuck.id)
