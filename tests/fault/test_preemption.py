"""Priority-aware preemption and cancellation with real prefork workers."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.store.db import schema as s
from conveyor.store.db.schema import leases
from conveyor.store.jobs import counted_attempts
from tasks.demo.models import effects
from tests.fault.conftest import Spawn
from tests.helpers import discarded, effect_count, eventually

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]

FAST = {"CONVEYOR_PREEMPT_GRACE": "0.5"}


def _markers(platform: Any, prefix: str) -> dict[str, dt.datetime]:
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(effects.c.note, effects.c.created_at).where(effects.c.note.like(f"{prefix}%"))
        )
        return {r.note: r.created_at for r in rows}


def _counted(platform: Any, handle: Any, stage: str) -> int:
    return counted_attempts(handle.row())


def _block_one_slot(platform: Any, tag: str) -> Any:
    blocker = platform.submit("conveyor.demo.effect", {"note": f"{tag}-blocker", "barrier": f"{tag}-b"})
    eventually(lambda: platform.redis.llen(f"{tag}-b:started") == 1, timeout=60)
    return blocker


def test_write_preempts_running_sync_while_every_slot_is_busy(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn(concurrency=2, env=FAST)
    blocker = _block_one_slot(platform, tag)
    holder = platform.submit(
        "conveyor.demo.sync", {"user": tag, "note": tag, "records": 10_000, "every": 10, "per_record": 0.001}
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    preemptor = platform.submit("conveyor.demo.write", {"user": tag, "note": f"{tag}w"})
    assert preemptor.wait(60) == s.SUCCEEDED
    assert holder.wait(120) == s.SUCCEEDED
    marks = _markers(platform, tag)
    resumed = min(
        t for note, t in marks.items() if note.startswith(f"{tag}:start:") and not note.endswith(":1")
    )
    assert marks[f"{tag}w:start"] < resumed  # the preemptor ran before the holder resumed
    submitted_at = preemptor.row()["created_at"]
    assert (marks[f"{tag}w:start"] - submitted_at).total_seconds() < 5
    topics = [e.topic for e in holder.events()[0]]
    assert "job.preempted" in topics and "job.dead" not in topics
    assert _counted(platform, holder, "conveyor.demo.sync") == 1  # preemption counts no attempt
    assert effect_count(platform, note=f"{tag}:done") == 1
    platform.redis.rpush(f"{tag}-b:go", "go")
    assert blocker.wait(60) == s.SUCCEEDED


def test_holder_ignoring_checkpoints_is_interrupted_after_grace(
    platform: Any, spawn: Spawn, tag: str, tmp_path: Path
) -> None:
    spawn(concurrency=2, env=FAST)
    blocker = _block_one_slot(platform, tag)
    holder = platform.submit(
        "conveyor.demo.sync",
        {
            "user": tag,
            "note": tag,
            "records": 300,
            "per_record": 0.01,
            "ignore_checkpoints_on_first_attempt": True,
        },
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    preemptor = platform.submit("conveyor.demo.write", {"user": tag, "note": f"{tag}w"})
    assert preemptor.wait(60) == s.SUCCEEDED
    assert holder.wait(120) == s.SUCCEEDED
    marks = _markers(platform, tag)
    assert f"{tag}:cleanup:1" in marks  # its finally ran: interrupted, not killed
    assert marks[f"{tag}w:start"] < min(
        t for n, t in marks.items() if n.startswith(f"{tag}:start:") and n != f"{tag}:start:1"
    )
    topics = [e.topic for e in holder.events()[0]]
    assert "job.interrupt_sent" in topics and "job.preempted" in topics
    assert _counted(platform, holder, "conveyor.demo.sync") == 1
    with platform.engine.connect() as conn:
        lease = conn.execute(select(leases).where(leases.c.key == f"user:{tag}")).mappings().one()
    assert lease["holder_job"] is None  # released by compare-and-release
    logs = "".join(p.read_text() for p in tmp_path.glob("worker-*.log"))
    assert "Discarding revoked task" not in logs
    platform.redis.rpush(f"{tag}-b:go", "go")
    assert blocker.wait(60) == s.SUCCEEDED


def test_cancel_while_every_worker_is_stopped(platform: Any, spawn: Spawn, tag: str) -> None:
    handle = platform.submit("conveyor.demo.effect", {"note": tag})
    assert handle.cancel(by="test", reason="not needed") == s.CANCELLED
    assert handle.cancel(by="test") == s.CANCELLED  # idempotent
    spawn()
    eventually(lambda: discarded(platform, handle.id), timeout=60)
    row = handle.row()
    assert row["status"] == s.CANCELLED and row["started_at"] is None
    assert row["cancelled_by"] == "test" and row["cancel_reason"] == "not needed"
    assert effect_count(platform, note=tag) == 0


def test_cancel_running_job_stops_at_checkpoint(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn(env=FAST)
    handle = platform.submit(
        "conveyor.demo.sync", {"user": tag, "note": tag, "records": 100_000, "per_record": 0.001}
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    assert handle.cancel(by="test") == s.RUNNING
    assert handle.wait(30) == s.CANCELLED
    assert f"{tag}:cleanup:1" in _markers(platform, tag)
    assert effect_count(platform, note=f"{tag}:done") == 0
