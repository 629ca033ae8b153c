"""The per-job path's shortcuts (issue #16) keep their promises under the faults they skip
checks for: the lane's kept connection dying, a wake-up connection killed, a submit()'s
job costing the result backend nothing while a Celery caller's result is still stored."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from redis import Redis
from sqlalchemy.exc import DBAPIError

from conveyor.delivery.wakeups import Wakeups
from conveyor.errors import is_connection_loss
from conveyor.store.db import lane as lane_module
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from conveyor.store.db.lane import Lane
from conveyor.store.jobs import JobStore, NewJob

pytestmark = pytest.mark.timeout(120)


def _queued_job(platform: Any, tag: str) -> str:
    with platform.engine.begin() as conn:
        job_id, _ = JobStore(lease_timeout=60).insert(
            conn,
            NewJob(stage="conveyor.demo.noop", queue="demo", payload={"n": 1}, max_attempts=3, label=tag),
        )
    return job_id


def _backend_pid(lane: Lane) -> int:
    fairy = lane._local.fairy  # the connection this thread keeps
    assert fairy is not None
    return int(fairy.driver_connection.info.backend_pid)


def _terminate(platform: Any, pid: int) -> None:
    with platform.engine.connect() as conn:
        conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
        conn.commit()


def test_the_lane_claims_and_completes_once_per_attempt(platform: Any, tag: str) -> None:
    lane = Lane(platform.engine, platform.settings.db_schema)
    job_id = _queued_job(platform, tag)
    row = lane.claim(job_id, owner="host:1:x", task_id=tag)
    assert row is not None and row["status"] == s.RUNNING and row["attempts"] == 1
    assert row["payload"] == {"n": 1} and row["options"] == {}
    assert lane.claim(job_id, owner="host:1:x", task_id=tag) is None  # running: no second claim
    assert not lane.succeed(job_id, 2, {"ok": True}, "conveyor.demo.noop")  # another attempt's
    assert lane.succeed(job_id, 1, {"ok": True}, "conveyor.demo.noop")
    assert not lane.succeed(job_id, 1, {"ok": True}, "conveyor.demo.noop")  # already done
    handle = platform.job(job_id)
    assert handle.status() == s.SUCCEEDED and handle.result == {"ok": True}
    topics = [e.topic for e in handle.events()[0]]
    assert topics.count("job.succeeded") == 1
    lane.close()


def test_a_killed_kept_connection_is_an_outage_then_replaced(platform: Any, tag: str) -> None:
    lane = Lane(platform.engine, platform.settings.db_schema)
    first = _queued_job(platform, tag)
    assert lane.claim(first, owner="host:1:x", task_id=tag) is not None
    _terminate(platform, _backend_pid(lane))
    second = _queued_job(platform, tag)
    with pytest.raises(DBAPIError) as caught:
        lane.claim(second, owner="host:1:x", task_id=tag)
    # What the runner sees: a lost connection (requeue uncounted), not the job's failure.
    assert is_connection_loss(caught.value)
    row = lane.claim(second, owner="host:1:x", task_id=tag)  # a fresh connection
    assert row is not None and row["attempts"] == 1
    lane.close()


def test_a_query_error_keeps_the_connection(platform: Any, tag: str) -> None:
    lane = Lane(platform.engine, platform.settings.db_schema)
    job_id = _queued_job(platform, tag)
    assert lane.claim(job_id, owner="host:1:x", task_id=tag) is not None
    pid = _backend_pid(lane)
    with pytest.raises(DBAPIError) as caught:
        lane.succeed(job_id, 1, float("nan"), "conveyor.demo.noop")  # NaN is not JSON
    assert not is_connection_loss(caught.value)
    assert lane.succeed(job_id, 1, {"n": 1}, "conveyor.demo.noop")
    assert _backend_pid(lane) == pid
    lane.close()


def test_an_idle_connection_dropped_by_the_server_costs_a_reconnect(
    platform: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane = Lane(platform.engine, platform.settings.db_schema)
    assert lane.claim(_queued_job(platform, tag), owner="host:1:x", task_id=tag) is not None
    _terminate(platform, _backend_pid(lane))
    monkeypatch.setattr(lane_module, "PING_AFTER", 0.0)  # every call counts as after an idle spell
    time.sleep(0.01)
    assert lane.claim(_queued_job(platform, tag), owner="host:1:x", task_id=tag) is not None
    lane.close()


def test_without_a_pool_nothing_is_kept(platform: Any, tag: str) -> None:
    engine = make_engine(platform.settings.database_url, pool_size=0, schema=platform.settings.db_schema)
    try:
        lane = Lane(engine, platform.settings.db_schema)
        assert lane.claim(_queued_job(platform, tag), owner="host:1:x", task_id=tag) is not None
        assert getattr(lane._local, "fairy", None) is None
    finally:
        engine.dispose()


def test_only_the_main_thread_keeps_a_connection(platform: Any, tag: str) -> None:
    """A prefork child runs its jobs on its main thread, which keeps its connection; other
    threads (a web server's, maybe short-lived) give theirs back after each call."""
    lane = Lane(platform.engine, platform.settings.db_schema)
    kept: list[Any] = []

    def claim() -> None:
        assert lane.claim(_queued_job(platform, tag), owner="host:1:x", task_id=tag) is not None
        kept.append(getattr(lane._local, "fairy", None))

    thread = threading.Thread(target=claim)
    thread.start()
    thread.join()
    assert kept == [None]
    assert lane.claim(_queued_job(platform, tag), owner="host:1:x", task_id=tag) is not None
    assert lane._local.fairy is not None
    lane.close()


def _waiter(redis: Redis, channel: str) -> Any:
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    return pubsub


def _next(pubsub: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.5)
        if msg is not None:
            return msg["data"]
    return None


def test_wakeups_arrive_and_survive_a_killed_connection(platform: Any, tag: str) -> None:
    redis = Redis.from_url(platform.settings.redis_url)
    wakeups = Wakeups(redis)
    channel = f"conveyor:test-wake:{tag}"
    pubsub = _waiter(redis, channel)
    try:
        wakeups.publish(channel, "succeeded")
        assert _next(pubsub) == b"succeeded"
        # Redis drops the reply-less connection; the next sends reconnect.
        name = f"wake-{uuid.uuid4().hex[:8]}"
        wakeups._local.conn.send_command("CLIENT", "SETNAME", name)
        ids = [c["id"] for c in redis.client_list() if c.get("name") == name]
        assert len(ids) == 1
        redis.client_kill_filter(_id=ids[0])
        delivered = None
        for _ in range(5):  # a send into a socket Redis closed may be lost once
            wakeups.publish(channel, "dead")
            delivered = _next(pubsub, timeout=1.0)
            if delivered is not None:
                break
        assert delivered == b"dead"
        # No reply is ever read: the connection holds nothing back after many sends.
        for _ in range(200):
            wakeups.publish(channel, "x")
        assert _next(pubsub) == b"x"
    finally:
        pubsub.close()
        wakeups.close()


def test_a_completion_sends_its_wake_up(platform: Any, worker: Any, tag: str) -> None:
    redis = Redis.from_url(platform.settings.redis_url)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(platform.connections.broker.wake_channel("*"))
    pubsub.get_message(timeout=1.0)
    try:
        handle = platform.submit("conveyor.demo.square", {"n": 5})
        channel = platform.connections.broker.wake_channel(handle.id).encode()
        deadline = time.monotonic() + 30
        woken = None
        while woken is None and time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=0.5)
            if msg is not None and msg["channel"] == channel:
                woken = msg["data"]
        assert woken == b"succeeded"  # the waiter's hint, sent without awaiting a reply
        assert handle.wait(30) == s.SUCCEEDED and handle.result == {"n": 25}
    finally:
        pubsub.close()


def test_submit_costs_the_result_backend_nothing_a_celery_call_still_gets_its_result(
    platform: Any, worker: Any, tag: str
) -> None:
    redis = Redis.from_url(platform.settings.redis_url)
    handle = platform.submit("conveyor.demo.square", {"n": 3})
    assert handle.wait(30) == s.SUCCEEDED and handle.result == {"n": 9}
    assert handle.row()["options"] == {s.IGNORE_RESULT: True}
    assert redis.get(f"celery-task-meta-{handle.id}") is None
    task = platform.app.tasks["conveyor.demo.square"]
    result = task.delay(n=4)
    assert result.get(timeout=30) == {"n": 16}
    assert redis.get(f"celery-task-meta-{result.id}") is not None


def test_the_broker_transport_reuses_one_client_per_channel(platform: Any) -> None:
    from conveyor.delivery.transport import Channel

    if platform.settings.broker_is_amqp():
        pytest.skip("conveyor.delivery.transport is the Redis broker's")

    with platform.app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as one, channel.conn_or_acquire() as two:
            assert one is two
            assert one.ping()


def test_psycopg_is_the_lane_driver(platform: Any) -> None:
    lane = Lane(platform.engine, platform.settings.db_schema)
    assert lane.claim(str(uuid.uuid4()), owner="host:1:x", task_id="t") is None  # no such job
    assert isinstance(lane._local.fairy.driver_connection, psycopg.Connection)
    lane.close()


def test_an_unreachable_server_is_an_outage_from_the_first_connect(platform: Any) -> None:
    from tests.integration.http_support import free_port

    engine = make_engine(
        f"postgresql://postgres@127.0.0.1:{free_port()}/nothing", pool_size=2, connect_timeout=2
    )
    try:
        lane = Lane(engine, platform.settings.db_schema)
        with pytest.raises(DBAPIError) as caught:
            lane.claim(str(uuid.uuid4()), owner="host:1:x", task_id="t")
        assert is_connection_loss(caught.value)  # requeued uncounted, never the job's failure
    finally:
        engine.dispose()


def test_a_delivery_is_noted_with_its_unacked_entry(platform: Any, worker: Any, tag: str) -> None:
    """conveyor.delivery.transport writes the worker's delivery note in kombu's own transaction."""
    from conveyor.delivery import transport

    if platform.settings.broker_is_amqp():
        pytest.skip("conveyor.delivery.transport is the Redis broker's")

    assert platform.app.conf.broker_transport == transport.NAME
    handle = platform.submit("conveyor.demo.square", {"n": 2})
    assert handle.wait(30) == s.SUCCEEDED
    redis = Redis.from_url(platform.settings.redis_url)
    prefix = platform.settings.key_prefix
    noted = [
        key
        for key in redis.scan_iter(match=f"{prefix}delivered:*")
        if redis.zscore(key, handle.id) is not None
    ]
    assert len(noted) == 1, noted  # one worker took it, and noted it once
