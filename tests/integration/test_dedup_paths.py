"""Every path that creates a job takes the same dedup decision as ``submit()``: chain links,
link callbacks, chord members, beat firings and DLQ retries.

The holder is a delayed job (queued, not yet due): live for simple dedup, so the solo
in-process worker is free to run the rest of the flow while the holder waits.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from celery import chain, chord, signature
from celery.beat import ScheduleEntry, Scheduler
from sqlalchemy import select, update

import tasks.demo as demo
from conveyor.errors import PermanentError, RetryRefused
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters, job_events, jobs
from tests.helpers import dead_letter_for, effect_count, eventually, job_row

pytestmark = pytest.mark.timeout(120)

HOLD = 4.0  # seconds the holder stays queued (live) before it runs


def _topics(platform: Any, job_id: str) -> list[str]:
    with platform.engine.connect() as conn:
        q = select(job_events.c.topic).where(job_events.c.job_id == job_id).order_by(job_events.c.id)
        return [str(t) for t in conn.execute(q).scalars()]


def _holder(platform: Any, user: str, note: str) -> Any:
    handle = platform.submit("conveyor.demo.keyed", {"user": user, "note": note}, delay=HOLD)
    assert not handle.deduplicated
    return handle


def _jobs_of_stage_for(platform: Any, user: str) -> list[Any]:
    with platform.engine.connect() as conn:
        rows = conn.execute(select(jobs).where(jobs.c.stage == "conveyor.demo.keyed")).mappings().all()
    return [r for r in rows if r["payload"].get("user") == user]


def test_chain_link_deduplicated_waits_for_holder_and_continues(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-holder")
    tail_note = f"{tag}-tail"
    result = chain(
        demo.square_stage.si(n=2),
        demo.keyed.si(user=tag, note=f"{tag}-link"),
        demo.effect.s(note=tail_note),
    ).apply_async()
    tail = platform.job(result.id)
    # The link was created as a follower of the holder, not as a second job that runs.
    link = eventually(lambda: [r for r in _jobs_of_stage_for(platform, tag) if r["id"] != holder.id])
    assert len(link) == 1 and link[0]["status"] == s.WAITING_DEDUP
    assert holder.status() == s.QUEUED  # still waiting for its delay
    assert holder.wait(30) == s.SUCCEEDED
    eventually(lambda: job_row(platform, tail.id) is not None, timeout=30)
    assert tail.wait(30) == s.SUCCEEDED
    follower = job_row(platform, link[0]["id"])
    assert follower["status"] == s.SUCCEEDED
    assert follower["result"] == holder.row()["result"]
    assert follower["started_at"] is None  # it never ran: the holder's outcome is its own
    # The holder's effect happened once; the link's own effect never did.
    assert effect_count(platform, note=f"{tag}-holder") == 1
    assert effect_count(platform, note=f"{tag}-link") == 0
    assert effect_count(platform, note=tail_note) == 1
    assert result.get(timeout=10) == tail.result
    assert "job.following" in _topics(platform, follower["id"])
    assert "job.deduplicated" in _topics(platform, holder.id)


def test_link_callback_deduplicated_follows_holder(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-holder")
    demo.square_stage.apply_async(kwargs={"n": 3}, link=demo.keyed.si(user=tag, note=f"{tag}-cb"))
    follower = eventually(lambda: [r for r in _jobs_of_stage_for(platform, tag) if r["id"] != holder.id])[0]
    assert follower["status"] == s.WAITING_DEDUP
    assert holder.wait(30) == s.SUCCEEDED
    eventually(lambda: job_row(platform, follower["id"])["status"] == s.SUCCEEDED, timeout=15)
    assert effect_count(platform, note=f"{tag}-cb") == 0


def test_chord_member_deduplicated_counts_when_holder_finishes(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-holder")
    body_note = f"{tag}-body"
    result = chord(
        [demo.keyed.si(user=tag, note=f"{tag}-member"), demo.square_stage.si(n=3)],
        demo.effect.si(note=body_note),
    ).apply_async()
    body = platform.job(result.id)
    time.sleep(1.0)
    assert job_row(platform, body.id) is None  # the chord waits for the holder
    assert holder.wait(30) == s.SUCCEEDED
    eventually(lambda: job_row(platform, body.id) is not None, timeout=30)
    assert body.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=body_note) == 1
    assert effect_count(platform, note=f"{tag}-member") == 0
    assert effect_count(platform, note=f"{tag}-holder") == 1


def test_follower_of_a_dead_holder_is_dead_lettered_naming_it(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-h")
    result = chain(demo.square_stage.si(n=2), demo.keyed.si(user=tag, note=f"{tag}-f")).apply_async()
    follower_id = result.id
    eventually(lambda: (job_row(platform, follower_id) or {}).get("status") == s.WAITING_DEDUP, timeout=30)
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, holder.id)
        assert platform.store.dead_letter(
            conn, row, error_type="PermanentError", message="bad input", tb_text=None, from_status=(s.QUEUED,)
        )
    platform.finished(holder.id, s.DEAD, dedup_key=row["dedup_key"])
    eventually(lambda: job_row(platform, follower_id)["status"] == s.DEAD, timeout=15)
    letter = dead_letter_for(platform, follower_id)
    assert holder.id in letter["message"] and "bad input" in letter["message"]
    with pytest.raises(PermanentError, match=holder.id):
        result.get(timeout=10)  # the chain's caller hears of it instead of waiting forever


def test_follower_of_a_cancelled_holder_runs_itself(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-h")
    result = chain(demo.square_stage.si(n=2), demo.keyed.si(user=tag, note=f"{tag}-f")).apply_async()
    eventually(lambda: (job_row(platform, result.id) or {}).get("status") == s.WAITING_DEDUP, timeout=30)
    assert platform.cancel(holder.id) == s.CANCELLED
    assert platform.job(result.id).wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-f") == 1
    assert effect_count(platform, note=f"{tag}-h") == 0


def test_duplicate_beat_firing_is_dropped_with_event(platform: Any, worker: Any, tag: str) -> None:
    holder = _holder(platform, tag, f"{tag}-holder")
    scheduler = Scheduler(platform.app, lazy=True)
    entry = ScheduleEntry(
        name=f"keyed-{tag}",
        task="conveyor.demo.keyed",
        schedule=dt.timedelta(seconds=60),
        kwargs={"user": tag, "note": f"{tag}-beat"},
        app=platform.app,
    )
    scheduler.apply_async(entry)
    scheduler.apply_async(entry)
    time.sleep(0.5)
    assert [r["id"] for r in _jobs_of_stage_for(platform, tag)] == [holder.id]
    eventually(lambda: _topics(platform, holder.id).count("job.deduplicated") >= 2, timeout=15)
    assert holder.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-beat") == 0


def _dead(platform: Any, handle: Any) -> int:
    """Dead-letter a still-queued job directly; returns its DLQ entry id."""
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, handle.id)
        assert platform.store.dead_letter(
            conn, row, error_type="PermanentError", message="boom", tb_text=None, from_status=(s.QUEUED,)
        )
    platform.finished(handle.id, s.DEAD, dedup_key=row["dedup_key"])
    return int(dead_letter_for(platform, handle.id)["id"])


def test_dlq_retry_is_refused_while_another_job_holds_the_dedup_id(platform: Any, tag: str) -> None:
    # j1 sleeps when it runs again: it must still hold the id when "again" is submitted.
    j1 = platform.submit("conveyor.demo.keyed", {"user": tag, "note": "1", "sleep": 5}, delay=3600)
    entry = _dead(platform, j1)
    j2 = platform.submit("conveyor.demo.keyed", {"user": tag, "note": "2"}, delay=3600)
    assert not j2.deduplicated
    with pytest.raises(RetryRefused, match=j2.id):
        platform.dlq.retry(entry)
    assert j1.status() == s.DEAD and j2.status() == s.QUEUED
    with platform.engine.connect() as conn:
        q = select(dead_letters.c.retried_at).where(dead_letters.c.id == entry)
        open_entry = conn.execute(q).scalar()
    assert open_entry is None  # still open: retry it once j2 is done
    platform.cancel(j2.id)
    assert platform.dlq.retry(entry) == j1.id
    assert j1.status() in (s.QUEUED, s.RUNNING)
    # j1 holds the dedup id again: a new submit returns it.
    again = platform.submit("conveyor.demo.keyed", {"user": tag, "note": "3"}, delay=3600)
    assert again.deduplicated and again.id == j1.id
    assert j1.wait(30) == s.SUCCEEDED


def test_dlq_retry_all_pages_past_garbage(platform: Any, tag: str) -> None:
    stage = "conveyor.demo.broken"
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    job = platform.submit(stage, {"n": 1}, delay=3600)
    _dead(platform, job)
    with platform.engine.begin() as conn:
        for i in range(450):
            platform.store.record_garbage(
                conn, error_type="UnknownTask", message=f"garbage {tag} {i}", headers={"task": stage}
            )
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.message.like(f"garbage {tag} %"))
            .values(stage=stage, queue="demo")
        )
    retried = platform.dlq.retry_all(stage=stage, since=since)
    assert job.id in retried
    assert dead_letter_for(platform, job.id)["retried_at"] is not None


def test_plain_celery_message_with_a_chain_follows_the_holder(platform: Any, worker: Any, tag: str) -> None:
    """``send_task`` by name (adopted at claim) carrying a chain: deduplicated, it follows
    the holder and the chain runs with the holder's result (it used to vanish)."""
    holder = _holder(platform, tag, f"{tag}-holder")
    tail_note = f"{tag}-tail"
    tail = signature("conveyor.demo.effect", kwargs={"note": tail_note}, options={"queue": "demo"})
    platform.app.send_task(
        "conveyor.demo.keyed", kwargs={"user": tag, "note": f"{tag}-sent"}, queue="demo", chain=[tail]
    )
    follower = eventually(lambda: [r for r in _jobs_of_stage_for(platform, tag) if r["id"] != holder.id])[0]
    assert follower["status"] == s.WAITING_DEDUP
    assert holder.wait(30) == s.SUCCEEDED
    eventually(lambda: effect_count(platform, note=tail_note) == 1, timeout=30)
    assert job_row(platform, follower["id"])["status"] == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-sent") == 0


def test_invalid_plain_celery_payload_is_kept_for_a_retry_after_a_fix(platform: Any, worker: Any) -> None:
    result = platform.app.send_task("conveyor.demo.square", kwargs={"n": "not a number"}, queue="demo")

    def adopted() -> Any:
        with platform.engine.connect() as conn:
            return conn.execute(select(jobs).where(jobs.c.origin_task_id == result.id)).mappings().first()

    row = eventually(lambda: (r := adopted()) is not None and r["status"] == s.DEAD and r, timeout=30)
    assert row["payload"] == {"n": "not a number"}
