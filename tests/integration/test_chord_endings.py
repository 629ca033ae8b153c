"""Every way a chord member ends is counted in its chord, so the chord's caller never
waits forever: the body runs once every member succeeded, and otherwise the caller's
``get()`` raises (``TaskRevokedError`` for a cancelled or expired member, as Celery does for
a revoked one) and the body's result is a ``ChordError`` once the counter is full.

Members end here by running (succeeded, failed), as followers of a dedup holder (its
result, its death, or cancelled while following), cancelled while queued or running, and
expired. The in-process solo worker runs them; a holder is a delayed job (live, queued).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import chord, states
from celery.exceptions import ChordError, TaskRevokedError
from celery.result import AsyncResult
from sqlalchemy import update

import tasks.demo as demo
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import jobs
from tests.helpers import effect_count, eventually, job_row

pytestmark = pytest.mark.timeout(120)

HOLD = 3600.0  # a holder that stays queued (live) until the test ends it


def _holder(platform: Any, user: str) -> Any:
    handle = platform.submit("conveyor.demo.keyed", {"user": user, "note": f"{user}-holder"}, delay=HOLD)
    assert not handle.deduplicated
    return handle


def _status(platform: Any, job_id: str) -> str | None:
    row = job_row(platform, job_id)
    return None if row is None else str(row["status"])


def _body_state(platform: Any, body_id: str) -> str:
    """The body's state in the result backend, read without its parents (no propagation)."""
    return str(AsyncResult(body_id, app=platform.app).state)


def _members(result: Any) -> list[str]:
    return [r.id for r in result.parent.results]


@pytest.mark.parametrize("by", ["platform", "client"])
def test_cancelled_follower_member_counts_and_get_raises(
    platform: Any, worker: Any, tag: str, by: str, request: pytest.FixtureRequest
) -> None:
    """The issue's case: a member deduplicated into a live holder is cancelled while it
    follows (by the deployment, or by a client such as the HTTP API's). It is counted, as
    revoked: the body never runs and ``get()`` raises instead of timing out."""
    cancel = (platform if by == "platform" else request.getfixturevalue("client")).cancel
    holder = _holder(platform, tag)
    result = chord(
        [demo.keyed.si(user=tag, note=f"{tag}-member"), demo.square_stage.si(n=3)],
        demo.effect.si(note=f"{tag}-body"),
    ).apply_async()
    follower = _members(result)[0]
    eventually(lambda: _status(platform, follower) == s.WAITING_DEDUP, timeout=30)
    assert cancel(follower) == s.CANCELLED
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    # The counter reached the chord's size: Celery failed the body, naming the member.
    eventually(lambda: _body_state(platform, result.id) == states.FAILURE, timeout=20)
    with pytest.raises(ChordError, match=follower):
        AsyncResult(result.id, app=platform.app).get(timeout=5)
    assert AsyncResult(follower, app=platform.app).state == states.REVOKED
    assert platform.cancel(holder.id) == s.CANCELLED
    assert job_row(platform, result.id) is None  # the body was never submitted
    assert effect_count(platform, note=f"{tag}-member") == 0


def test_every_way_a_member_ends_is_counted(platform: Any, worker: Any, tag: str) -> None:
    """One chord whose members end every way there is; its body's result is ready (a
    ChordError) only once all of them were counted."""
    dead_holder = _holder(platform, f"{tag}-d")
    live_holder = _holder(platform, f"{tag}-l")
    ok_holder = _holder(platform, f"{tag}-o")
    barrier = f"{tag}:run"
    members = [
        demo.square_stage.si(n=2),  # succeeded
        demo.broken.si(n=1),  # failed: dead-lettered by its body
        demo.keyed.si(user=f"{tag}-o", note=f"{tag}-dup"),  # follows a holder that succeeds
        demo.keyed.si(user=f"{tag}-d", note=f"{tag}-dead"),  # follows a holder that dies
        demo.keyed.si(user=f"{tag}-l", note=f"{tag}-cf"),  # cancelled while following
        demo.effect.si(note=f"{tag}-cq").set(countdown=HOLD),  # cancelled while queued
        demo.effect.si(note=f"{tag}-cr", barrier=barrier, checkpoint=True),  # cancelled running
        demo.effect.si(note=f"{tag}-ex").set(countdown=1.0, expires=0.5),  # expired
    ]
    result = chord(members, demo.effect.si(note=f"{tag}-body")).apply_async()
    ids = _members(result)
    eventually(lambda: all(_status(platform, ids[i]) == s.WAITING_DEDUP for i in (2, 3, 4)), timeout=30)
    with platform.engine.begin() as conn:  # due now: the relay publishes it, the worker runs it
        conn.execute(update(jobs).where(jobs.c.id == ok_holder.id).values(run_at=db_now()))
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, dead_holder.id)
        assert platform.store.dead_letter(
            conn, row, error_type="PermanentError", message="bad input", tb_text=None, from_status=(s.QUEUED,)
        )
    platform.finished(dead_holder.id, s.DEAD, dedup_key=row["dedup_key"])
    assert platform.cancel(ids[4]) == s.CANCELLED
    assert platform.cancel(ids[5]) == s.CANCELLED
    eventually(lambda: platform.redis.lrange(f"{barrier}:started", 0, -1), timeout=30)
    assert platform.cancel(ids[6]) == s.RUNNING  # asked to stop: its checkpoint ends it
    platform.redis.rpush(f"{barrier}:go", "go")
    ends = [s.SUCCEEDED, s.DEAD, s.SUCCEEDED, s.DEAD, s.CANCELLED, s.CANCELLED, s.CANCELLED, s.EXPIRED]
    eventually(lambda: [_status(platform, i) for i in ids] == ends, timeout=30)
    eventually(lambda: _body_state(platform, result.id) == states.FAILURE, timeout=30)
    with pytest.raises(ChordError):
        AsyncResult(result.id, app=platform.app).get(timeout=5)
    assert job_row(platform, result.id) is None
    assert platform.job(live_holder.id).cancel() == s.CANCELLED
    assert ok_holder.wait(5) == s.SUCCEEDED
