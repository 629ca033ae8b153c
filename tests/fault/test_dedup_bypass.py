"""delay(), send_task by name and a duplicate raw message all meet the same dedup layer.

Needs a worker with free slots while the holder is held on a barrier, hence a real
prefork worker here."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

import tasks.demo as demo
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from tests.fault.conftest import Spawn
from tests.helpers import discarded, effect_count, eventually, publish_again

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


def _topics(handle: Any) -> list[str]:
    return [e.topic for e in handle.events()[0]]


def test_no_path_bypasses_dedup(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn(concurrency=3)
    holder = platform.submit("conveyor.demo.keyed", {"user": tag, "note": tag, "barrier": tag})
    eventually(lambda: platform.redis.llen(f"{tag}:started") == 1, timeout=60)

    via_delay = demo.keyed.delay(user=tag, note=tag)
    assert via_delay.job.deduplicated and via_delay.job.id == holder.id

    sent = platform.app.send_task("conveyor.demo.keyed", kwargs={"user": tag, "note": tag}, queue="demo")
    eventually(lambda: _topics(holder).count("job.deduplicated") >= 2, timeout=60)

    row = holder.row()
    publish_again(platform, row, task_id=row["celery_task_id"])
    eventually(lambda: discarded(platform, holder.id), timeout=60)

    platform.redis.rpush(f"{tag}:go", "go")
    assert holder.wait(60) == s.SUCCEEDED
    assert effect_count(platform, note=tag) == 1
    # The send_task follows the holder (its caller holds an AsyncResult) and never runs.
    assert sent.get(timeout=30) == holder.result
    with platform.engine.connect() as conn:
        n = conn.execute(
            select(func.count())
            .select_from(jobs)
            .where(jobs.c.dedup_key == f"conveyor.demo.keyed:user:{tag}", jobs.c.attempts > 0)
        ).scalar_one()
    assert n == 1
