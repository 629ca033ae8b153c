"""``Deferred``: a body asks to be run again later (a peer's rate limit). The job is parked
``throttled`` for the seconds asked, its attempt uncounted and not a requeue, its lease
released, with ``job.deferred`` events; ``max_deferred`` bounds the seconds in all, past
which a deferral counts as a transient failure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from conveyor.errors import Deferred
from conveyor.retry import Backoff
from conveyor.store.db import schema as s
from tests.helpers import eventually, job_row, module_stages

pytestmark = pytest.mark.timeout(120)
PREFIX = "conveyor.deferral."
# How many times each ref has run (the body is in this process: the worker is in-process).
RUNS: dict[str, int] = {}


class Ask(BaseModel):
    ref: str
    times: int = 1  # defer this many times, then succeed
    seconds: float = 0.2
    user: str = "u"


def _deferring(ctx: Any, p: Ask) -> dict[str, Any]:
    RUNS[p.ref] = RUNS.get(p.ref, 0) + 1
    if RUNS[p.ref] <= p.times:
        raise Deferred(p.seconds, f"peer says wait (run {RUNS[p.ref]})")
    return {"runs": RUNS[p.ref]}


@pytest.fixture(scope="module")
def declared(platform: Any) -> Iterator[Any]:
    found = {
        "defers": platform.stage(
            f"{PREFIX}defers",
            payload=Ask,
            queue="demo",
            max_attempts=2,
            retry=Backoff(base=0.1, cap=0.1),
            lease_key="deferral:{user}",
            max_deferred=3.0,
        )(_deferring),
        "short": platform.stage(
            f"{PREFIX}short", payload=Ask, queue="demo", max_attempts=1, max_deferred=0.5
        )(_deferring),
    }
    with module_stages(platform, PREFIX, found) as stages:
        yield stages


def test_a_deferred_job_waits_its_seconds_uncounted_then_runs(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    handle = platform.submit(f"{PREFIX}defers", {"ref": tag, "times": 3, "seconds": 0.3})
    started = time.monotonic()
    assert handle.wait(30) == s.SUCCEEDED
    assert time.monotonic() - started >= 0.9  # three waits of 0.3 s, each honoured
    row = job_row(platform, handle.id)
    # Four claims, three of them uncounted: one counted attempt of max_attempts=2.
    assert (row["attempts"], row["uncounted"], row["requeues"]) == (4, 3, 0)
    assert row["result"] == {"runs": 4}
    deferred = [e for e in handle.events()[0] if e.topic == "job.deferred"]
    assert [e.body["seconds"] for e in deferred] == [0.3, 0.3, 0.3]
    assert deferred[0].body["reason"] == "peer says wait (run 1)"


def test_a_deferral_parks_the_job_throttled_until_due_and_frees_its_lease(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    handle = platform.submit(f"{PREFIX}defers", {"ref": tag, "times": 1, "seconds": 2.5, "user": tag})
    eventually(lambda: job_row(platform, handle.id)["status"] == s.THROTTLED)
    row = job_row(platform, handle.id)
    assert row["lease_owner"] is None and row["published_at"] is None
    assert (row["run_at"] - row["updated_at"]).total_seconds() == pytest.approx(2.5, abs=0.3)
    # The user's lease is free while it waits: another job of the same key runs now.
    other = platform.submit(f"{PREFIX}defers", {"ref": f"{tag}-other", "times": 0, "user": tag})
    assert other.wait(10) == s.SUCCEEDED
    assert job_row(platform, handle.id)["status"] == s.THROTTLED
    assert handle.wait(30) == s.SUCCEEDED


def test_past_max_deferred_a_deferral_counts_as_a_transient_failure(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    # 3 s in all: the fourth deferral of 1 s would pass it, and counts (attempt 1 of 2);
    # the fifth run defers again and counts again: dead-lettered, saying why.
    handle = platform.submit(f"{PREFIX}defers", {"ref": tag, "times": 99, "seconds": 1.0})
    assert handle.wait(60) == s.DEAD
    row = job_row(platform, handle.id)
    assert row["uncounted"] == 3 and row["attempts"] - row["uncounted"] == 2
    assert "max_deferred of 3s" in row["last_error"] and "peer says wait" in row["last_error"]
    topics = [e.topic for e in handle.events()[0]]
    assert topics.count("job.deferred") == 3 and "job.retrying" in topics


def test_a_single_deferral_longer_than_the_bound_fails_at_once(
    platform: Any, declared: Any, worker: Any, tag: str
) -> None:
    handle = platform.submit(f"{PREFIX}short", {"ref": tag, "times": 1, "seconds": 5.0})
    assert handle.wait(30) == s.DEAD
    row = job_row(platform, handle.id)
    assert row["uncounted"] == 0
    assert "deferred 0s in all, and 5s more would pass the stage's max_deferred of 0.5s" in row["last_error"]


def test_conveyor_stages_sets_max_deferred(platform: Any) -> None:
    from conveyor.settings import StageOverride
    from conveyor.stages import Stages

    settings = platform.settings.model_copy(
        update={"stages": {f"{PREFIX}tuned": StageOverride(max_deferred=30)}}
    )

    class Holder:
        pass

    holder = Holder()
    holder.settings = settings  # type: ignore[attr-defined]
    stages = Stages(platform.app, holder, queue_names=["demo"], default_queue="demo")
    register = stages.declare(
        f"{PREFIX}tuned",
        payload=Ask,
        queue="demo",
        max_attempts=None,
        retry=None,
        time_limit=None,
        soft_time_limit=None,
        concurrency=None,
        max_deferred=5.0,
    )
    assert register(_deferring).max_deferred == 30
    assert platform.stages[f"{PREFIX}short"].max_deferred == 0.5
