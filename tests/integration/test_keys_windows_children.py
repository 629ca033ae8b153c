"""Platform pieces the publisher family is built on, each with a plain stage: keyed
concurrency (a job over its key's limit parked, other keys unhindered, woken when a slot
of its key frees), blackout windows at claim, ``reschedule`` and ``ctx.submit``."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy.orm import Session

from conveyor.calendar import Window
from conveyor.dedup import Dedup
from conveyor.errors import PermanentError
from conveyor.store.db import schema as s
from conveyor.upkeep.reconciler import TickReport
from conveyor.upkeep.relay import next_due
from tests.helpers import eventually, job_row, module_stages

pytestmark = pytest.mark.timeout(120)
PREFIX = "conveyor.pieces."
WINDOWS: dict[str, Window] = {}


class Keyed(BaseModel):
    key: str
    ref: str = ""


class Parent(BaseModel):
    ref: str
    fail: bool = False
    children: int = 1


def _noop(ctx: Any, p: Keyed) -> str:
    return p.ref


def _windows(p: Keyed) -> tuple[Window, ...]:
    window = WINDOWS.get(p.key)
    return (window,) if window is not None else ()


def _parent(ctx: Any, p: Parent) -> str:
    for i in range(p.children):
        ctx.submit(f"{PREFIX}child", {"key": p.ref, "ref": f"{p.ref}-{i % 1}"})
    if p.fail:
        raise PermanentError("the parent failed after asking for its child")
    return p.ref


@pytest.fixture(scope="module")
def declared(platform: Any) -> Iterator[Any]:
    found = {
        "keyed": platform.stage(
            f"{PREFIX}keyed", payload=Keyed, queue="demo", concurrency=1, concurrency_key="k:{key}"
        )(_noop),
        "windowed": platform.stage(f"{PREFIX}windowed", payload=Keyed, queue="demo", blackout=_windows)(
            _noop
        ),
        "parent": platform.stage(f"{PREFIX}parent", payload=Parent, queue="demo", max_attempts=1)(_parent),
        "child": platform.stage(
            f"{PREFIX}child", payload=Keyed, queue="demo", dedup=Dedup(mode="id", fields=("key", "ref"))
        )(_noop),
    }
    with module_stages(platform, PREFIX, found) as stages:
        yield stages


def _topics(handle: Any) -> list[str]:
    return [e.topic for e in handle.events()[0]]


def test_a_job_over_its_keys_limit_waits_for_a_slot_of_its_key_only(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    admission = platform.admission
    held = admission.check(
        queue="demo",
        rate=None,
        stage=f"{PREFIX}keyed",
        concurrency=1,
        job_id=f"holder-{tag}",
        key=f"k:{tag}-a",
    )
    assert held.slot is not None
    waiting = platform.submit(f"{PREFIX}keyed", {"key": f"{tag}-a"})
    other = platform.submit(f"{PREFIX}keyed", {"key": f"{tag}-b"})
    assert other.wait(30) == s.SUCCEEDED  # another key is not held back
    eventually(lambda: job_row(platform, waiting.id)["status"] == s.THROTTLED)
    [parked] = [e for e in waiting.events()[0] if e.topic == "job.rate_limited"]
    assert parked.body["reason"] == "concurrency" and parked.body["key"] == f"k:{tag}-a"
    # Parked until woken, not for throttle_wait: its run_at is the slot lifetime away.
    assert job_row(platform, waiting.id)["run_at"] > job_row(platform, waiting.id)[
        "updated_at"
    ] + dt.timedelta(seconds=platform.settings.lease_timeout / 2)
    freed = time.monotonic()
    platform.runner.gate.release(held.slot)
    assert waiting.wait(30) == s.SUCCEEDED
    assert time.monotonic() - freed < platform.settings.lease_timeout / 2
    assert "job.unparked" in _topics(waiting) and job_row(platform, waiting.id)["attempts"] == 1


def test_a_copy_of_a_running_job_never_gives_back_the_slot_the_job_runs_with(
    platform: Any, declared: Any, tag: str
) -> None:
    admission, gate = platform.admission, platform.runner.gate
    take = lambda job: admission.check(  # noqa: E731
        queue="demo", rate=None, stage=f"{PREFIX}keyed", concurrency=1, job_id=job, key=f"k:{tag}"
    )
    running = take(f"job-{tag}").slot
    assert running is not None and running.fresh
    copy = take(f"job-{tag}").slot  # a second delivery of the same job (a wake and the relay)
    assert copy is not None and not copy.fresh
    gate.give_back(copy)  # its claim found the job running: it does not run
    assert take(f"other-{tag}").reason == "concurrency"  # the running job still holds it
    gate.release(running)
    assert take(f"other-{tag}").slot is not None


def test_a_job_due_inside_a_blackout_window_is_parked_until_its_end(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    now = dt.datetime.now(dt.UTC)
    end = (now + dt.timedelta(seconds=2)).replace(microsecond=0) + dt.timedelta(seconds=1)
    WINDOWS[tag] = Window(
        name=f"w-{tag}", start=now.time().replace(microsecond=0), end=end.time(), timezone="UTC"
    )
    handle = platform.submit(f"{PREFIX}windowed", {"key": tag})
    assert handle.wait(30) == s.SUCCEEDED
    [parked] = [e for e in handle.events()[0] if e.topic == "job.blackout"]
    assert parked.body["window"] == f"w-{tag}" and parked.body["until"] == end.isoformat()
    row = job_row(platform, handle.id)
    assert row["started_at"] >= end and row["attempts"] == 1 and row["uncounted"] == 0


def test_reschedule_moves_a_waiting_job_and_refuses_a_finished_one(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    later = platform.submit(f"{PREFIX}keyed", {"key": f"{tag}-r"}, delay=3600)
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    assert platform.reschedule(later.id, soon)
    row = job_row(platform, later.id)
    assert row["status"] == s.QUEUED and abs((row["run_at"] - soon).total_seconds()) < 0.01
    with Session(platform.engine) as session:  # in the caller's transaction: rolled back, unmoved
        assert platform.reschedule(later.id, dt.datetime.now(dt.UTC), session=session)
        session.rollback()
    assert abs((job_row(platform, later.id)["run_at"] - soon).total_seconds()) < 0.01
    assert platform.reschedule(later.id, dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    assert later.wait(30) == s.SUCCEEDED
    assert not platform.reschedule(later.id, soon)
    assert "job.rescheduled" in _topics(later)
    with pytest.raises(ValueError, match="aware"):
        platform.reschedule(later.id, dt.datetime(2030, 1, 1))


def test_a_throttled_job_rescheduled_waits_queued_for_its_new_time(
    platform: Any, declared: Any, tag: str
) -> None:
    handle = platform.submit(f"{PREFIX}keyed", {"key": f"{tag}-t"}, delay=3600)
    with platform.engine.begin() as conn:
        conn.execute(s.jobs.update().where(s.jobs.c.id == handle.id).values(status=s.THROTTLED))
    when = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    assert platform.reschedule(handle.id, when)
    row = job_row(platform, handle.id)
    assert row["status"] == s.QUEUED and row["published_at"] is None
    platform.cancel(handle.id)


def test_children_are_submitted_with_the_completion_and_only_then(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    ok = platform.submit(f"{PREFIX}parent", {"ref": f"{tag}-ok", "children": 3}, owner=f"own-{tag}")
    assert ok.wait(30) == s.SUCCEEDED
    failed = platform.submit(f"{PREFIX}parent", {"ref": f"{tag}-no", "fail": True})
    assert failed.wait(30) == s.DEAD
    with platform.engine.connect() as conn:
        rows = conn.execute(
            s.jobs.select().where(s.jobs.c.stage == f"{PREFIX}child", s.jobs.c.label.is_not(None))
        ).mappings()
        mine = [r for r in rows if r["payload"]["key"] in (f"{tag}-ok", f"{tag}-no")]
    # Three asks of the same (key, ref): one child (the stage's dedup), none of the failed parent.
    assert len(mine) == 1 and mine[0]["payload"]["key"] == f"{tag}-ok" and mine[0]["owner"] == f"own-{tag}"
    assert platform.job(mine[0]["id"]).wait(30) == s.SUCCEEDED


def test_ctx_submit_refuses_an_unknown_stage_in_the_body(platform: Any, declared: Any, tag: str) -> None:
    from conveyor.worker.context import ContextServices, JobContext

    runner = platform.runner
    ctx = JobContext(
        ContextServices(platform.connections, platform.store, platform.stops, platform.continuations),
        job_id=str(uuid.uuid4()),
        attempt=1,
        stage=f"{PREFIX}parent",
        flow_id=None,
    )
    try:
        with pytest.raises(Exception, match="unknown stage"):
            ctx.submit("conveyor.pieces.nope", {})
        with pytest.raises(TypeError, match="unexpected option"):
            ctx.submit(f"{PREFIX}child", {"key": "k"}, countdown=3)
    finally:
        ctx.close()
    assert runner is not None


def test_the_relay_knows_when_the_next_job_falls_due(platform: Any, declared: Any, tag: str) -> None:
    handle = platform.submit(f"{PREFIX}keyed", {"key": f"{tag}-n"}, delay=5)
    report: TickReport = platform.relay().tick(reconcile=False)
    if not report.skipped_lock:  # the worker's relay holds the lock: its passes wake for it
        assert report.next_due is not None and report.next_due <= 5.0
    with platform.engine.connect() as conn:
        due = next_due(conn)
    assert due is not None and due <= 5.0
    platform.cancel(handle.id)
