"""A copy of a chord member that already succeeded, delivered under a fresh task id (the
relay republishes with fresh ids), must not count in the chord a second time: the body
would fire before the other members finish, with a result list missing theirs."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import chord

import tasks.demo as demo
from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn
from tests.helpers import discarded, effect_count, eventually, job_row, publish_again

pytestmark = pytest.mark.timeout(120)


def test_duplicate_of_a_finished_member_does_not_fire_the_chord_early(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    spawn(concurrency=2)
    barrier = f"{tag}:slow"
    result = chord(
        [demo.effect.si(note=f"{tag}-a"), demo.effect.si(note=f"{tag}-b", barrier=barrier)],
        demo.effect.si(note=f"{tag}-body"),
    ).apply_async()
    body_id = result.id
    header = [r.id for r in result.parent.results]
    fast = platform.job(header[0])
    assert fast.wait(60) == s.SUCCEEDED
    eventually(lambda: platform.redis.lrange(f"{barrier}:started", 0, -1), timeout=60)

    row = fast.row()
    publish_again(platform, row, task_id=f"copy-{uuid.uuid4()}")
    eventually(lambda: discarded(platform, fast.id), timeout=60)
    time.sleep(1.0)
    assert job_row(platform, body_id) is None, "the chord fired before its slow member finished"

    platform.redis.rpush(f"{barrier}:go", "go")
    eventually(lambda: job_row(platform, body_id) is not None, timeout=60)
    assert platform.job(body_id).wait(60) == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-body") == 1
