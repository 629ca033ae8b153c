"""Stages in canvases as Celery tasks are (#29, item 5): ``countdown``/``eta`` given to a
chain, a group, a chord or ``group | task`` delay the stages that run first, through the
database's ``run_at`` (Celery's ``t/integration/test_canvas.py``
``test_group_or_task_countdown_delays_header``); ``link``/``link_error`` on groups and
chords and a chord header's error reach their callbacks as in Celery; ``replace`` inside
a stage is refused with the reason (README, Differences from Celery)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import chain, chord, current_task, group
from sqlalchemy import select

from conveyor.errors import ConfigurationError, PermanentError, ReplaceRefused
from conveyor.shared import current_job
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from tests.helpers import eventually, job_row, module_stages

pytestmark = pytest.mark.timeout(120)

DELAY = 2.0


def stamp(x: int) -> str:
    return current_job().job_id


def gather(res: list[Any]) -> list[Any]:
    return res


def boom(x: int) -> int:
    raise PermanentError(f"boom {x}")


def on_error_old(task_id: str) -> str:
    return task_id


def request_seen() -> dict[str, Any]:
    req = current_task.request
    info = req.delivery_info or {}
    return {"eta": req.eta, "priority": info.get("priority"), "limits": list(req.timelimit or ())}


def replacing(x: int) -> Any:
    return current_task.replace(current_task.app.tasks["conveyor.canvasopt.stamp"].si(x))


@pytest.fixture(scope="module")
def canvas(platform: Any) -> Iterator[SimpleNamespace]:
    """This module's stages, for its tests only (removed afterwards, registry rows too)."""
    declared = {
        "stamp": platform.stage("conveyor.canvasopt.stamp", queue="demo")(stamp),
        "gather": platform.stage("conveyor.canvasopt.gather", queue="demo")(gather),
        "boom": platform.stage("conveyor.canvasopt.boom", queue="demo")(boom),
        "on_error_old": platform.stage("conveyor.canvasopt.on_error_old", queue="demo")(on_error_old),
        "replacing": platform.stage("conveyor.canvasopt.replacing", queue="demo")(replacing),
        "seen": platform.stage("conveyor.canvasopt.seen", queue="demo")(request_seen),
    }
    with module_stages(platform, "conveyor.canvasopt.", declared) as declared_stages:
        yield declared_stages


def _waited(platform: Any, job_id: str) -> float:
    """Seconds between the job's row being written and its body starting (database clock)."""
    row = job_row(platform, job_id)
    assert row.started_at is not None, job_id
    return (row.started_at - row.created_at).total_seconds()


def _first_ids(res: Any) -> list[str]:
    while res.parent is not None:
        res = res.parent
    return [r.id for r in getattr(res, "results", None) or [res]]


def test_countdown_and_eta_delay_every_canvas_shape(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_chord::test_group_or_task_countdown_delays_header
    # (there: 0.012 s elapsed). All shapes at once: one wait for the lot.
    def header() -> list[Any]:
        return [canvas.stamp.si(1), canvas.stamp.si(2)]

    shapes: dict[str, Any] = {
        "chain": chain(canvas.stamp.si(1), canvas.stamp.si(2)),
        "group": group(header()),
        "chord": chord(header(), canvas.gather.s()),
        "group | task": group(header()) | canvas.gather.s(),
        "chain(group, task)": chain(group(header()), canvas.gather.s()),
        "task | chord": chain(canvas.stamp.si(0), chord(header(), canvas.gather.s())),
    }
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=DELAY)
    results = {name: sig.apply_async(countdown=DELAY) for name, sig in shapes.items()}
    results["group | task, eta"] = (group(header()) | canvas.gather.s()).apply_async(eta=eta)
    results["group | task, set"] = (group(header()) | canvas.gather.s()).set(countdown=DELAY).apply_async()
    for name, res in results.items():
        res.get(timeout=60)
        for job_id in _first_ids(res):
            assert _waited(platform, job_id) >= DELAY - 0.3, (name, job_id)


def test_replace_in_a_stage_is_refused_naming_the_difference(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_chain::test_chain_replaced_with_a_chain_and_a_callback
    # and the other replace tests: the job ends dead with the reason, never left running.
    res = canvas.replacing.delay(3)
    with pytest.raises(ReplaceRefused, match="cannot replace itself"):
        res.get(timeout=60)
    row = job_row(platform, res.id)
    assert row.status == s.DEAD and row.attempts == 1, (row.status, row.attempts)
    assert "Differences from Celery" in (row.last_error or "")


def test_a_chord_header_error_reaches_the_body_errback(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_chord::test_chord_header_failure_errback-like: the body
    # fails with a ChordError and its errbacks run, given on the body or to apply_async
    body = canvas.gather.s().on_error(canvas.on_error_old.s())
    res = chord([canvas.stamp.si(1), canvas.boom.si(2)], body).apply_async()
    with pytest.raises(PermanentError, match="boom 2"):  # the header's, as Celery's get() raises it
        res.get(timeout=60)

    given = chord([canvas.boom.si(3)], canvas.gather.s()).apply_async(link_error=canvas.on_error_old.s())
    with pytest.raises(PermanentError, match="boom 3"):  # the header's, as Celery's get() raises it
        given.get(timeout=60)
    for body_id in (res.id, given.id):  # old style: the body's task id
        eventually(lambda body_id=body_id: _noted(platform, canvas, body_id), timeout=30)


def _noted(platform: Any, canvas: Any, task_id: str) -> Any:
    """The succeeded ``on_error_old`` job called with ``task_id``, if any."""
    with platform.engine.begin() as conn:
        rows = conn.execute(
            select(jobs).where(jobs.c.stage == canvas.on_error_old.name, jobs.c.status == s.SUCCEEDED)
        ).all()
    return next((r for r in rows if r.payload.get("task_id") == task_id), None)


def test_link_and_link_error_on_groups_and_chords(platform: Any, canvas: Any, worker: Any) -> None:
    # Celery's rules (celery/canvas.py): a group's link goes to its first task, immutable; its
    # link_error to every member; a chord's link and link_error to its body.
    marks = [f"mark-{uuid.uuid4()}" for _ in range(2)]
    g = group([canvas.stamp.si(1), canvas.stamp.si(2)])
    g.link(canvas.on_error_old.si(marks[0]))
    failing = group([canvas.stamp.si(3), canvas.boom.si(4)])
    failing.link_error(canvas.on_error_old.s())
    c = chord([canvas.stamp.si(5)], canvas.gather.s())
    c.link(canvas.on_error_old.si(marks[1]))
    g_res, failing_res, c_res = g.apply_async(), failing.apply_async(), c.apply_async()
    g_res.get(timeout=60)
    c_res.get(timeout=60)
    boom_id = failing_res.results[1].id
    for task_id in [*marks, boom_id]:
        eventually(lambda task_id=task_id: _noted(platform, canvas, task_id), timeout=30)


def test_a_calls_eta_priority_and_limits_reach_its_messages(platform: Any, canvas: Any, worker: Any) -> None:
    """``request.eta`` after a countdown, a call's ``priority`` and time limits, as Celery's
    messages carry them (test_canvas.py: test_chord::test_priority,
    test_chain::test_chord_soft_timeout_recuperation)."""
    res = canvas.seen.apply_async(countdown=0.5, priority=3, time_limit=5, soft_time_limit=2)
    seen = res.get(timeout=30)
    assert seen["eta"] is not None and seen["priority"] == 3 and seen["limits"] == [5, 2]
    with pytest.raises(ConfigurationError, match="may only shorten it"):
        canvas.seen.apply_async(time_limit=10_000)


def _children(platform: Any, job_id: str) -> list[Any]:
    with platform.engine.connect() as conn:
        return list(conn.execute(select(jobs).where(jobs.c.parent_id == job_id)).mappings())


def test_two_callbacks_of_one_task_are_two_jobs(platform: Any, canvas: Any, worker: Any) -> None:
    """test_canvas.py::test_chord::test_link_option_runs_after_the_body: the body's own link
    and the chord's, both of one task, both run."""
    first, second = canvas.stamp.s(), canvas.stamp.s()
    res = canvas.stamp.apply_async((1,), link=[first, second])
    res.get(timeout=30)
    links = eventually(lambda: (rows := _children(platform, res.id)) and len(rows) == 2 and rows)
    assert len({r["id"] for r in links}) == 2
