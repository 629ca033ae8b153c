"""Stages in canvases as Celery tasks are (#29): the ids a stage's request carries in
chains, groups and chords (Celery's ``t/integration/test_canvas.py`` ``test_parent_ids``
rules), and stages used as ``link_error`` errbacks, new style and old style."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import chain, chord, current_task, group
from sqlalchemy import select

from conveyor.errors import PermanentError
from conveyor.runfile import owner_id
from conveyor.shared import current_job
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import ClaimOutcome, NewJob
from tests.helpers import eventually, job_row, module_stages, publish_again

pytestmark = pytest.mark.timeout(120)


def _seen(i: int) -> dict[str, Any]:
    req = current_task.request
    chord_body = req.chord
    return {
        "id": req.id,
        "root_id": req.root_id,
        "parent_id": req.parent_id,
        "group": req.group,
        "group_index": req.group_index,
        "chord": chord_body["task"] if chord_body else None,
        "job": current_job().job_id,
        "i": i,
    }


def ids(i: int) -> dict[str, Any]:
    return _seen(i)


def collect_ids(res: list[dict[str, Any]], i: int) -> list[Any]:
    return [res, _seen(i)]


def retried_ids(i: int) -> dict[str, Any]:
    if current_job().attempt == 1:
        raise RuntimeError("once")  # the retry is published again by the relay
    return _seen(i)


def spawn(i: int) -> str:
    if current_job().attempt == 1:
        raise RuntimeError("once")
    return str(current_task.app.tasks["conveyor.canvas.ids"].delay(i + 1).id)


def boom(x: int) -> int:
    raise PermanentError(f"boom {x}")


def on_error(request, exc, traceback):  # type: ignore[no-untyped-def]  # as a Celery user writes it
    assert request.id == request["id"] and str(exc) == exc["message"]  # as Celery's errbacks read them
    return {"request": request, "exc": exc, "traceback": traceback, "job": current_job().job_id}


def on_error_old(task_id: str) -> str:
    return task_id


@pytest.fixture(scope="module")
def canvas(platform: Any) -> Iterator[SimpleNamespace]:
    """This module's stages, for its tests only (removed afterwards, registry rows too)."""
    from conveyor.retry import Schedule

    declared = {
        "ids": platform.stage("conveyor.canvas.ids", queue="demo")(ids),
        "collect_ids": platform.stage("conveyor.canvas.collect_ids", queue="demo")(collect_ids),
        "retried_ids": platform.stage(
            "conveyor.canvas.retried_ids", queue="demo", retry=Schedule((0.2,)), max_attempts=2
        )(retried_ids),
        "spawn": platform.stage(
            "conveyor.canvas.spawn", queue="demo", retry=Schedule((0.2,)), max_attempts=2
        )(spawn),
        "boom": platform.stage("conveyor.canvas.boom", queue="demo")(boom),
        "on_error": platform.stage("conveyor.canvas.on_error", queue="demo")(on_error),
        "on_error_old": platform.stage("conveyor.canvas.on_error_old", queue="demo")(on_error_old),
    }
    with module_stages(platform, "conveyor.canvas.", declared) as declared_stages:
        yield declared_stages


def _root_of(res: Any) -> Any:
    while res.parent is not None:
        res = res.parent
    return res


def test_chain_ids_follow_celery(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_chain::test_parent_ids; a retried link (published
    # again by the relay, with another message id) keeps its task id and its parent's.
    res = chain(
        canvas.ids.si(i=0), canvas.ids.si(i=1), canvas.retried_ids.si(i=2), canvas.ids.si(i=3)
    ).apply_async()
    res.get(timeout=60)
    root, node, i = _root_of(res), res, 3
    while node is not None:
        seen = node.get(timeout=30)
        assert seen["i"] == i
        assert seen["id"] == seen["job"] == node.id  # the job id stays the task id
        assert seen["parent_id"] == (node.parent.id if node.parent is not None else None)
        assert seen["root_id"] == root.id
        assert seen["group"] is None and seen["chord"] is None
        node, i = node.parent, i - 1
    assert i == -1


def test_group_after_a_chain_ids_follow_celery(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_group::test_parent_ids
    members = [canvas.ids.si(i=3), canvas.retried_ids.si(i=4), canvas.ids.si(i=5)]
    res = (canvas.ids.si(i=1) | canvas.ids.si(i=2) | group(members))()
    values = res.get(timeout=60)
    assert [v["i"] for v in values] == [3, 4, 5]
    for index, (seen, member) in enumerate(zip(values, res.results, strict=True)):
        assert seen["id"] == seen["job"] == member.id
        assert seen["root_id"] == res.parent.parent.id
        assert seen["parent_id"] == res.parent.id
        assert seen["group"] == res.id
        assert seen["group_index"] == index
        assert seen["chord"] is None


def test_chord_in_a_chain_ids_follow_celery(platform: Any, canvas: Any, worker: Any) -> None:
    # t/integration/test_canvas.py::test_chord::test_parent_ids (and __OR)
    root = canvas.ids.si(i=1)
    expected_root_id = root.freeze().id
    res = chain(
        root,
        canvas.ids.si(i=2),
        chord(
            group(canvas.ids.si(i=i) for i in range(3, 6)),
            chain(canvas.collect_ids.s(i=50) | canvas.ids.si(i=51)),
        ),
    )()
    last = res.get(timeout=60)
    body, header, second = res.parent, res.parent.parent, res.parent.parent.parent
    assert (last["i"], last["root_id"], last["parent_id"]) == (51, expected_root_id, body.id)
    assert last["id"] == last["job"] == res.id
    prev, seen = body.get(timeout=30)
    assert (seen["i"], seen["root_id"]) == (50, expected_root_id)
    assert seen["parent_id"] in [r.id for r in header.results]  # fired by a header member
    assert seen["id"] == seen["job"] == body.id
    for index, member in enumerate(prev):
        assert member["root_id"] == expected_root_id
        assert member["parent_id"] == second.id
        assert member["group"] == header.id
        assert member["group_index"] == index
        assert member["chord"] == canvas.collect_ids.name
    first = second.parent.get(timeout=30)
    assert second.get(timeout=30)["parent_id"] == second.parent.id == expected_root_id
    assert (first["root_id"], first["parent_id"]) == (expected_root_id, None)


def test_a_stage_sending_a_stage_is_its_parent(platform: Any, canvas: Any, worker: Any) -> None:
    # Celery's send_task inside a task: the sender is the parent, its root the root; a
    # retried sender (another message id) still names its own task id.
    res = chain(canvas.ids.si(i=1), canvas.spawn.si(i=2)).apply_async()
    child = platform.app.AsyncResult(res.get(timeout=30))
    seen = child.get(timeout=30)
    assert (seen["parent_id"], seen["root_id"], seen["id"]) == (res.id, res.parent.id, child.id)
    assert job_row(platform, child.id)["parent_id"] == res.id


def _errback_job(platform: Any, failed: str, stage: str) -> Any:
    def find() -> Any:
        with platform.engine.connect() as conn:
            row = (
                conn.execute(select(jobs).where(jobs.c.parent_id == failed, jobs.c.stage == stage))
                .mappings()
                .first()
            )
        return row if row is not None and row["status"] == s.SUCCEEDED else None

    return eventually(find, timeout=30)


def test_stage_errbacks_run_as_jobs_with_what_celery_passes(platform: Any, canvas: Any, worker: Any) -> None:
    # New style (request, exc, traceback) and old style (task_id), as Celery decides by arity.
    res = canvas.boom.apply_async(args=(7,), link_error=[canvas.on_error.s(), canvas.on_error_old.s()])
    with pytest.raises(Exception, match="boom 7"):
        res.get(timeout=30)
    failed = job_row(platform, res.id)
    assert failed["status"] == s.DEAD
    new = _errback_job(platform, res.id, canvas.on_error.name)
    out = platform.job(new["id"]).result
    assert out["job"] == new["id"]
    request = out["request"]
    assert (request["id"], request["task"], request["root_id"]) == (res.id, canvas.boom.name, res.id)
    assert request["kwargs"] == {"x": 7} and request["args"] == []
    assert out["exc"] == {"type": "PermanentError", "message": "boom 7"}
    assert "Traceback" in out["traceback"] and "boom 7" in out["traceback"]
    old = _errback_job(platform, res.id, canvas.on_error_old.name)
    assert platform.job(old["id"]).result == res.id
    assert old["options"]["root_id"] == res.id


def test_a_buried_stage_runs_its_errbacks(platform: Any, canvas: Any, worker: Any) -> None:
    # Its worker died in its last attempt: dead-lettered at the next claim, errbacks run.
    gone = subprocess.Popen(["true"])
    gone.wait()
    errbacks = [dict(canvas.on_error.s()), dict(canvas.on_error_old.s())]
    new = NewJob(stage=canvas.boom.name, queue="demo", payload={"x": 3}, max_attempts=1)
    new.options = {"link_error": errbacks}
    with platform.engine.begin() as conn:
        job_id, _ = platform.store.insert(conn, new)
        claim = platform.store.claim(conn, job_id, owner=owner_id(gone.pid), task_id="first")
        assert claim.outcome is ClaimOutcome.RUN
    publish_again(platform, job_row(platform, job_id), task_id=str(uuid.uuid4()))
    old = _errback_job(platform, job_id, canvas.on_error_old.name)
    assert platform.job(old["id"]).result == job_id
    out = platform.job(_errback_job(platform, job_id, canvas.on_error.name)["id"]).result
    assert (out["request"]["id"], out["exc"]["type"]) == (job_id, "WorkerLost")
    assert job_row(platform, job_id)["status"] == s.DEAD
