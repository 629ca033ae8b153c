"""Kills at the worst moments. Kill points are Redis barriers, never sleeps; effects are rows
in a table without a unique constraint, so a duplicate would show."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from celery import chain

import tasks.demo as demo
from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn, kill_group
from tests.helpers import dead_letter_for, effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


def _started(platform: Any, barrier: str, n: int = 1, timeout: float = 60) -> list[str]:
    r = platform.redis
    return eventually(
        lambda: (lambda v: v if len(v) >= n else None)(r.lrange(f"{barrier}:started", 0, -1)), timeout
    )


def _open(platform: Any, barrier: str, n: int = 10) -> None:
    platform.redis.rpush(f"{barrier}:go", *["go"] * n)


def test_sigkill_main_process_mid_body(platform: Any, spawn: Spawn, tag: str) -> None:
    first = spawn()
    flow = chain(
        demo.effect.s(note=f"{tag}-a", barrier=tag),
        demo.effect.si(note=f"{tag}-b"),
    ).apply_async()
    _started(platform, tag)
    kill_group(first)
    _open(platform, tag)
    spawn()
    last = platform.job(flow.id)
    eventually(lambda: job_row(platform, last.id) is not None, timeout=90)
    assert last.wait(90) == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-a") == 1
    assert effect_count(platform, note=f"{tag}-b") == 1
    head = job_row(platform, job_row(platform, last.id)["parent_id"])
    assert head["status"] == s.SUCCEEDED and head["attempts"] == 2
    assert "job.stalled" in [e.topic for e in platform.job(head["id"]).events()[0]]


def test_sigkill_after_completion_commit_before_ack(platform: Any, spawn: Spawn, tag: str) -> None:
    fast_restore = {
        "CONVEYOR_VISIBILITY_TIMEOUT": "6",
        "CONVEYOR_DEFAULT_TIME_LIMIT": "5",
        "CONVEYOR_DEFAULT_SOFT_TIME_LIMIT": "4",
    }
    first = spawn(env=fast_restore)
    flow = chain(
        demo.effect.s(note=f"{tag}-a", kill_worker_after_commit=True),
        demo.effect.si(note=f"{tag}-b"),
    ).apply_async()
    eventually(lambda: first.poll() is not None, timeout=60)  # it killed itself after commit
    head_id = flow.parent.id
    assert job_row(platform, head_id)["status"] == s.SUCCEEDED
    spawn(env=fast_restore)
    assert platform.job(flow.id).wait(90) == s.SUCCEEDED
    # The unacked original may come back after the visibility timeout: a duplicate delivery
    # of a succeeded job, which must not run the body again.
    assert effect_count(platform, note=f"{tag}-a") == 1
    assert effect_count(platform, note=f"{tag}-b") == 1


def test_sigkill_pool_child_is_taken_over(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn()
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    job_id, attempt, pid = _started(platform, tag)[0].decode().split(":")
    assert job_id == handle.id and attempt == "1"
    os.kill(int(pid), signal.SIGKILL)
    _open(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    assert effect_count(platform, note=tag) == 1
    assert handle.row()["attempts"] == 2
    assert "job.stalled" in [e.topic for e in handle.events()[0]]


def test_sigterm_mid_job_finishes_within_soft_shutdown(platform: Any, spawn: Spawn, tag: str) -> None:
    w = spawn()
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    _started(platform, tag)
    w.send_signal(signal.SIGTERM)
    _open(platform, tag)
    assert w.wait(timeout=60) == 0
    assert handle.wait(30) == s.SUCCEEDED
    assert handle.row()["attempts"] == 1
    assert effect_count(platform, note=tag) == 1


def test_child_crashing_every_attempt_is_dead_lettered(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn()
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "crash_until_attempt": 99})
    assert handle.wait(120) == s.DEAD
    row = handle.row()
    assert row["attempts"] == row["max_attempts"] == 4
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "WorkerLost" and "giving up" in letter["message"]
    assert effect_count(platform, note=tag) == 0
    assert platform.submit("conveyor.demo.square", {"n": 2}).wait(60) == s.SUCCEEDED  # still up


def test_hard_time_limit_is_recorded_once_and_not_retried(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn(env={"CONVEYOR_STAGES": '{"conveyor.demo.effect": {"time_limit": 2, "soft_time_limit": 1}}'})
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": 30, "ignore_soft_limit": True})
    assert handle.wait(60) == s.DEAD
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "TimeLimitExceeded" and "hard time limit" in letter["message"]
    assert handle.row()["attempts"] == 1
    assert effect_count(platform, note=tag) == 0
