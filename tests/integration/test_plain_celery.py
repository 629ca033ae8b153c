"""A caller's own Celery app calls stages by name: ``send_task`` through Conveyor's router.

The caller is a plain ``Celery`` app of its own (not the deployment's), against the real
Redis and Postgres and the in-process worker. The worker here does not consume Celery's
default queue (that is opt-in: ``test_default_queue.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

import conveyor
from conveyor.client import registry
from conveyor.contrib.celery import router
from conveyor.delivery.celeryconfig import CELERY_DEFAULT_QUEUE
from conveyor.errors import PayloadInvalid, PermanentError, TaskIdRefused, TransientError, UnknownStage
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters, jobs
from tests.helpers import dead_letter_for, discarded, effect_count, eventually, job_row

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client(platform: Any) -> Iterator[conveyor.Client]:
    """A Conveyor client on the test services, with the registry written."""
    registry.write(platform.engine, platform.stages.values())
    settings = platform.settings
    made = conveyor.connect(database_url=settings.database_url, redis_url=settings.redis_url)
    yield made
    made.close()


def _plain_app(platform: Any, name: str) -> Celery:
    # As the README says: the deployment's broker (RabbitMQ's URL when it has one), its
    # Redis as the result backend.
    settings = platform.settings
    return Celery(
        name, broker=settings.resolved_broker_url(), backend=settings.redis_url, set_as_current=False
    )


@pytest.fixture(scope="module")
def caller(platform: Any, client: conveyor.Client) -> Iterator[Celery]:
    """The caller's own Celery app, its routes from Conveyor's router."""
    app = _plain_app(platform, "caller")
    app.conf.task_routes = (router(client),)
    yield app
    app.close()


def _dead_letters_mentioning(platform: Any, text: str) -> list[Any]:
    with platform.engine.connect() as conn:
        q = select(dead_letters).where(dead_letters.c.message.like(f"%{text}%"))
        return list(conn.execute(q).mappings())


def test_the_router_routes_stages_only(client: conveyor.Client) -> None:
    route = router(client)
    found = route("conveyor.demo.square", (), {"n": 1}, {})
    assert found is not None and found["queue"].name == "demo"
    assert route("shop.orders.total", (), {}, {}) is None  # the app's own tasks: Celery's routes


def test_a_misspelt_stage_in_the_registrys_namespace_is_refused_not_sent(
    platform: Any, client: conveyor.Client, tag: str
) -> None:
    """``conveyor.`` is the registry's: a name there that is no stage raises before any
    message leaves (it would wait in ``celery`` forever); the caller's own tasks, even in
    that namespace, and names outside it keep Celery's routes."""
    app = _plain_app(platform, f"caller-{tag}")
    try:
        app.conf.task_routes = (router(client),)

        @app.task(name=f"conveyor.caller.{tag}")
        def own() -> None: ...

        with pytest.raises(UnknownStage, match=r"did you mean 'conveyor\.demo\.square'\?"):
            app.send_task("conveyor.demo.sqaure", kwargs={"n": 7}, task_id=f"{tag}-typo")
        with pytest.raises(UnknownStage, match=r"did you mean 'conveyor\.demo\.square'\?"):
            app.send_task("conveyor.dmeo.square", kwargs={"n": 7}, task_id=f"{tag}-typo2")
        routes = app.amqp.router
        assert routes.route({}, own.name, task_type=own)["queue"].name == CELERY_DEFAULT_QUEUE
        assert routes.route({}, "shop.orders.total")["queue"].name == CELERY_DEFAULT_QUEUE
        assert routes.route({}, "conveyor.demo.square")["queue"].name == "demo"
    finally:
        app.close()
    assert job_row(platform, f"{tag}-typo") is None and job_row(platform, f"{tag}-typo2") is None


def test_send_task_without_a_queue_runs_as_the_job_of_its_task_id(
    platform: Any, worker: Any, caller: Celery
) -> None:
    result = caller.send_task("conveyor.demo.square", kwargs={"n": 7})
    assert result.get(timeout=30) == {"n": 49}
    row = job_row(platform, result.id)
    assert row["id"] == result.id and row["status"] == s.SUCCEEDED and row["queue"] == "demo"
    assert platform.job(result.id).result == {"n": 49}


def test_without_the_router_a_message_waits_in_the_default_queue(platform: Any, worker: Any) -> None:
    """Consuming Celery's default queue is opt-in: here no worker does, and the message waits."""
    app = _plain_app(platform, "unrouted")
    try:
        result = app.send_task("conveyor.demo.square", kwargs={"n": 2})
        waiting = platform.broker.message_counts
        eventually(lambda: waiting([CELERY_DEFAULT_QUEUE])[CELERY_DEFAULT_QUEUE] == 1, timeout=5)
        assert job_row(platform, result.id) is None
        assert result.state == "PENDING"
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(CELERY_DEFAULT_QUEUE)
        app.close()


def test_a_payload_refused_at_adoption_raises_from_get(platform: Any, worker: Any, caller: Celery) -> None:
    result = caller.send_task("conveyor.demo.square", kwargs={"n": "seven"})
    with pytest.raises(PayloadInvalid, match=r"invalid payload for conveyor\.demo\.square: n: ") as raised:
        result.get(timeout=30)
    assert "seven" not in str(raised.value)
    assert job_row(platform, result.id)["status"] == s.DEAD
    letter = dead_letter_for(platform, result.id)
    assert letter["error_type"] == "PayloadInvalid"


def test_a_permanent_failure_raises_from_get(worker: Any, caller: Celery) -> None:
    result = caller.send_task("conveyor.demo.broken", kwargs={"n": 5})
    with pytest.raises(PermanentError, match="record 5 cannot be processed"):
        result.get(timeout=30)


def test_outcomes_of_republished_attempts_reach_the_first_task_id(
    platform: Any, worker: Any, caller: Celery
) -> None:
    """Retries run from messages the relay publishes with new task ids; the caller's id
    still gets the outcome, a success or the last attempt's failure."""
    ok = caller.send_task("conveyor.demo.flaky", kwargs={"n": 3, "fail_times": 1})
    dead = caller.send_task("conveyor.demo.flaky", kwargs={"n": 4, "fail_times": 9})
    assert ok.get(timeout=30) == {"n": 3, "attempts": 2}
    assert job_row(platform, ok.id)["celery_task_id"] != ok.id  # run by another publish
    with pytest.raises(TransientError, match="simulated transient fault on attempt 4"):
        dead.get(timeout=30)
    assert job_row(platform, dead.id)["status"] == s.DEAD


def test_a_reused_task_id_is_one_job(platform: Any, worker: Any, caller: Celery, tag: str) -> None:
    task_id = str(uuid.uuid4())
    first = caller.send_task("conveyor.demo.effect", kwargs={"note": tag}, task_id=task_id)
    assert first.get(timeout=30) == {"job_id": task_id}  # the body ran as the job of that id
    again = caller.send_task("conveyor.demo.effect", kwargs={"note": f"{tag}-again"}, task_id=task_id)
    eventually(lambda: "already_succeeded" in discarded(platform, task_id), timeout=30)
    assert again.get(timeout=10) == {"job_id": task_id}  # the first call's job and result
    assert effect_count(platform, note=tag) == 1 and effect_count(platform, note=f"{tag}-again") == 0
    with platform.engine.connect() as conn:
        rows = conn.execute(select(jobs.c.id).where(jobs.c.origin_task_id == task_id)).all()
    assert [r.id for r in rows] == [task_id]


def test_a_task_id_of_another_stage_is_refused(platform: Any, worker: Any, caller: Celery, tag: str) -> None:
    task_id = str(uuid.uuid4())
    assert caller.send_task("conveyor.demo.effect", kwargs={"note": tag}, task_id=task_id).get(timeout=30)
    caller.send_task("conveyor.demo.square", kwargs={"n": 1}, task_id=task_id)
    (letter,) = eventually(lambda: _dead_letters_mentioning(platform, task_id), timeout=30)
    assert letter["error_type"] == "TaskIdRefused" and letter["job_id"] is None
    assert "already the id of a job of stage conveyor.demo.effect" in letter["message"]
    assert job_row(platform, task_id)["stage"] == "conveyor.demo.effect"
    assert caller.AsyncResult(task_id).get(timeout=10) == {"job_id": task_id}  # untouched


def test_a_task_id_longer_than_a_job_id_is_refused(
    platform: Any, worker: Any, caller: Celery, tag: str
) -> None:
    task_id = f"order-{tag}-" + "x" * 40
    result = caller.send_task("conveyor.demo.square", kwargs={"n": 1}, task_id=task_id)
    with pytest.raises(TaskIdRefused, match="at most 36 characters"):
        result.get(timeout=30)
    (letter,) = _dead_letters_mentioning(platform, task_id[:40])
    assert letter["stage"] == "conveyor.demo.square" and letter["headers"]["id"] == task_id
    assert job_row(platform, task_id[:36]) is None


def test_a_duplicate_follows_its_holder_under_its_own_task_id(
    platform: Any, worker: Any, caller: Celery, tag: str
) -> None:
    holder = platform.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-holder"}, delay=2.0)
    result = caller.send_task("conveyor.demo.keyed", kwargs={"user": tag, "note": f"{tag}-dup"})
    row = eventually(lambda: job_row(platform, result.id), timeout=30)
    assert row["status"] == s.WAITING_DEDUP
    assert result.get(timeout=30) == {"job_id": holder.id}  # the holder's result
    assert holder.status() == s.SUCCEEDED and job_row(platform, result.id)["status"] == s.SUCCEEDED
    assert effect_count(platform, note=f"{tag}-dup") == 0
