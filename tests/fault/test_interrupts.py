"""Interrupts stop only the jobs that were asked to stop, and a stop request is seen even
when its Redis fast flag is lost."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from sqlalchemy import select, update

from conveyor.client.stops import PREEMPT
from conveyor.store.db import schema as s
from conveyor.store.db.schema import leases
from conveyor.worker.heartbeat import INTERRUPT_SIGNAL
from tests.fault.conftest import Spawn
from tests.fault.test_preemption import _markers
from tests.helpers import dead_letter_for, effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


def _running(platform: Any, handle: Any) -> Any:
    return eventually(lambda: (r := job_row(platform, handle.id))["status"] == s.RUNNING and r, timeout=60)


def test_an_interrupt_nobody_asked_for_is_ignored(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn()
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": 3})
    row = _running(platform, handle)
    arguments = {"job_id": handle.id, "attempt": row["attempts"], "task_id": row["celery_task_id"]}
    replies = platform.app.control.broadcast("conveyor_interrupt", arguments=arguments, reply=True, timeout=5)
    assert any("signalled" in str(r) for r in replies), replies
    os.kill(int(row["lease_owner"].split(":")[1]), INTERRUPT_SIGNAL)  # and a raw one
    assert handle.wait(60) == s.SUCCEEDED
    assert handle.row()["attempts"] == 1 and effect_count(platform, note=tag) == 1


def test_a_soft_time_limit_still_fires(platform: Any, spawn: Spawn, tag: str) -> None:
    spawn(env={"CONVEYOR_STAGES": '{"conveyor.demo.effect": {"time_limit": 10, "soft_time_limit": 1}}'})
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": 8})
    assert handle.wait(60) == s.DEAD
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "SoftTimeLimitExceeded" and "soft time limit" in letter["message"]
    assert handle.row()["attempts"] == 1


def test_preemption_request_seen_without_its_redis_flag(platform: Any, spawn: Spawn, tag: str) -> None:
    """The request is in Postgres only (the fast flag lost, e.g. with a Redis wipe): the
    holder still stops at a checkpoint within the grace, ends preempted, never dead."""
    spawn(env={"CONVEYOR_PREEMPT_GRACE": "2"})
    holder = platform.submit(
        "conveyor.demo.sync", {"user": tag, "note": tag, "records": 5000, "per_record": 0.001}
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    with platform.engine.begin() as conn:
        lease = conn.execute(select(leases).where(leases.c.key == f"user:{tag}")).mappings().one()
        assert platform.stops.request_preemption(conn, lease, by_job=f"{tag}-preemptor", priority=10)
    platform.redis.delete(f"{platform.settings.key_prefix}stop:{holder.id}")
    eventually(lambda: "job.preempted" in [e.topic for e in holder.events()[0]], timeout=10)
    with platform.engine.begin() as conn:  # the (imaginary) preemptor is done with the lease
        conn.execute(update(leases).where(leases.c.key == f"user:{tag}").values(reserved_job=None))
    assert holder.wait(120) == s.SUCCEEDED
    topics = [e.topic for e in holder.events()[0]]
    assert "job.dead" not in topics and "job.interrupt_sent" not in topics  # seen within the grace
    row = holder.row()
    assert row["attempts"] - row["uncounted"] == 1


def test_interrupt_before_the_request_is_known_still_stops_the_holder(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    """The escalation arrives before the holder has read the request (it ignores
    checkpoints and its fast flag is gone): it is preempted, not killed, not dead."""
    spawn(env={"CONVEYOR_PREEMPT_GRACE": "30"})  # the heartbeat would read Postgres only after 15 s
    holder = platform.submit(
        "conveyor.demo.sync",
        {
            "user": tag,
            "note": tag,
            # Long enough that the interrupt always lands inside the body (a 5 s body once
            # finished first on a loaded CI machine, and its end-of-body checkpoint was the
            # one preempted); the second attempt honours checkpoints and is cancelled below.
            "records": 120_000,
            "per_record": 0.001,
            "ignore_checkpoints_on_first_attempt": True,
        },
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    with platform.engine.begin() as conn:
        lease = conn.execute(select(leases).where(leases.c.key == f"user:{tag}")).mappings().one()
        assert platform.stops.request_preemption(conn, lease, by_job=f"{tag}-preemptor", priority=10)
        conn.execute(update(leases).where(leases.c.key == f"user:{tag}").values(reserved_job=None))
    row = job_row(platform, holder.id)
    os.kill(int(row["lease_owner"].split(":")[1]), signal.SIGUSR2)
    eventually(lambda: "job.preempted" in [e.topic for e in holder.events()[0]], timeout=10)
    assert f"{tag}:cleanup:1" in _markers(platform, tag)  # interrupted at a bytecode, not killed
    eventually(lambda: f"{tag}:start:2" in _markers(platform, tag), timeout=60)  # requeued, uncounted
    holder.cancel()
    assert holder.wait(60) == s.CANCELLED
    assert "job.dead" not in [e.topic for e in holder.events()[0]]
    row = holder.row()
    assert row["attempts"] - row["uncounted"] == 1


def test_a_later_interrupt_does_not_cut_the_stopping_body_short(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    """The holder stopped at its checkpoint and its ``finally`` is writing to the database
    when an interrupt for the same attempt arrives (the escalation, or a SIGUSR2 left
    pending while the child was frozen): it is dropped, the write runs to its end and the
    job is filed preempted, not requeued as an infrastructure failure."""
    spawn(env={"CONVEYOR_PREEMPT_GRACE": "30"})  # no escalation of the platform's own here
    holder = platform.submit(
        "conveyor.demo.sync",
        {"user": tag, "note": tag, "records": 100_000, "per_record": 0.001, "cleanup_hold": 2},
    )
    eventually(lambda: f"{tag}:start:1" in _markers(platform, tag), timeout=60)
    with platform.engine.begin() as conn:
        lease = conn.execute(select(leases).where(leases.c.key == f"user:{tag}")).mappings().one()
        assert platform.stops.request_preemption(conn, lease, by_job=f"{tag}-preemptor", priority=10)
    platform.stops.flag(holder.id, 1, PREEMPT, None)
    eventually(lambda: f"{tag}:cleaning:1" in _markers(platform, tag), timeout=30)
    row = job_row(platform, holder.id)
    arguments = {"job_id": holder.id, "attempt": 1, "task_id": row["celery_task_id"]}
    replies = platform.app.control.broadcast(
        "conveyor_interrupt", arguments=arguments, reply=True, timeout=10, limit=1
    )
    assert any("signalled" in str(r) for r in replies), replies
    topics = eventually(
        lambda: (
            (t := [e.topic for e in holder.events()[0]])
            and ("job.preempted" in t or "job.requeued" in t)
            and t
        ),
        timeout=30,
    )
    assert "job.preempted" in topics and "job.requeued" not in topics, topics
    assert f"{tag}:cleanup:1" in _markers(platform, tag)  # the cleanup write committed
    # Attempt 1 uncounted, not an infrastructure requeue. The preemption request stays on
    # the lease (its preemptor here never comes): the relay may already have handed the job
    # to attempt 2, which yields too, so at least one.
    row = holder.row()
    assert row["uncounted"] >= 1 and row["requeues"] == 0
