"""RabbitMQ as the broker, on this session's vhost: quorum queues, confirmed and mandatory
publishes, one unacknowledged delivery per pool slot, an epoch that a Redis wipe keeps."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.delivery.amqp import Unroutable
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from tests.conftest import AMQP_VHOST
from tests.fault.conftest import Spawn
from tests.helpers import effect_count, eventually, job_row
from tests.rabbit_support import ctl, delete_queue

pytestmark = pytest.mark.rabbitmq


def _queue_types() -> dict[str, tuple[str, str]]:
    out = ctl("list_queues", "-p", AMQP_VHOST, "name", "type", "durable")
    rows = [line.split("\t") for line in out.splitlines()]
    return {r[0]: (r[1], r[2]) for r in rows if len(r) == 3 and r[0] != "name"}


def _ready(platform: Any) -> int:
    """Messages ready in ``demo`` (a passive declare: exact, where ``rabbitmqctl`` reports
    the statistics of a few seconds ago)."""
    return platform.broker.message_counts(["demo"])["demo"]


def test_queues_are_durable_quorum_queues(platform: Any) -> None:
    platform.broker.epoch(max_age=0)  # declares every queue (and the epoch's marker)
    types = _queue_types()
    for queue in platform.queues:
        assert types[queue.name] == ("quorum", "true"), queue.name
    markers = [name for name in types if name.startswith(f"{platform.settings.key_prefix}epoch.")]
    assert markers and all(types[m] == ("quorum", "true") for m in markers)


def test_a_publish_no_queue_takes_fails_and_the_relay_declares_and_sends_it(platform: Any, tag: str) -> None:
    platform.broker.epoch(max_age=0)
    # Jobs an earlier test of the session left unpublished go now, and with the queue: in a
    # full run the relay's tick below sent one of them too (2 ready, not 1).
    platform.relay().tick()
    delete_queue(AMQP_VHOST, "demo")
    with pytest.raises(Unroutable):
        platform.broker.publish(
            stage="conveyor.demo.noop",
            job_id=f"{tag}-x",
            queue="demo",
            payload={"n": 1},
            options={},
            fast=True,
        )
    # A submit whose publish was returned leaves the job to the relay, which declares the
    # missing queue and sends it again.
    handle = platform.submit("conveyor.demo.effect", {"note": tag})
    assert handle.row()["published_at"] is None
    report = platform.relay().tick()
    assert 1 <= _ready(platform) <= report.published + report.republished
    assert job_row(platform, handle.id)["published_at"] is not None


def test_a_redis_wipe_republishes_nothing_rabbitmq_still_holds(platform: Any, tag: str) -> None:
    relay = platform.relay()
    relay.tick()
    before = _ready(platform)
    handles = [platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}"}) for i in range(5)]
    epoch = platform.broker.epoch(max_age=0)
    assert all(job_row(platform, h.id)["broker_epoch"] == epoch for h in handles)
    platform.redis.flushdb()  # Redis wiped: its cached epoch and every Conveyor key gone
    platform.broker._epoch = None
    relay.tick()
    relay.tick()
    assert platform.broker.epoch(max_age=0) == epoch  # read back from Postgres, marker found
    assert _ready(platform) == before + 5  # nothing sent twice
    with platform.engine.connect() as conn:
        published = conn.execute(select(jobs.c.published_at).where(jobs.c.id.in_([h.id for h in handles])))
        assert len(list(published)) == 5


def test_a_worker_killed_mid_job_has_its_message_redelivered_at_once(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    """RabbitMQ hands an unacked delivery back as soon as the channel closes: no
    visibility timeout to wait for. The job runs again elsewhere and its effect lands once."""
    import os
    import signal

    victim = spawn(concurrency=1)
    handle = platform.submit(
        "conveyor.demo.effect", {"note": tag, "barrier": f"{tag}-b", "barrier_timeout": 30}
    )
    eventually(lambda: platform.redis.llen(f"{tag}-b:started") == 1, timeout=60)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    spawn(concurrency=1)
    eventually(lambda: platform.redis.llen(f"{tag}-b:started") == 2, timeout=60)
    started = time.monotonic()
    platform.redis.rpush(f"{tag}-b:go", "go", "go")
    assert handle.wait(60) == s.SUCCEEDED
    assert time.monotonic() - started < 30
    assert effect_count(platform, note=tag) == 1


def test_queue_length_gauges_read_rabbitmq(platform: Any, tag: str) -> None:
    """`conveyor top` and the Prometheus gauges count RabbitMQ's ready messages, not Redis lists."""
    from conveyor.upkeep.gauges import queue_lengths

    before = _ready(platform)
    for i in range(3):
        platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}"})
    assert queue_lengths(platform.connections, ["demo"]) == {"demo": before + 3}


def test_a_client_left_on_redis_publishes_nothing_there_and_the_relay_sends_its_jobs(
    platform: Any, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An app that was not given CONVEYOR_BROKER_URL would publish to Redis lists no worker
    reads. It sees from the epoch that the workers' broker is RabbitMQ, says so once, and
    leaves its jobs to the relay, which publishes them there."""
    import conveyor

    platform.relay().tick()  # the RabbitMQ epoch, cached in Redis
    stray = conveyor.connect(platform.settings.model_copy(update={"broker_url": None}))
    try:
        before = _ready(platform)
        handles = [stray.submit("conveyor.demo.effect", {"note": f"{tag}-{i}"}) for i in range(2)]
        assert all(h.row()["published_at"] is None for h in handles)
        assert platform.redis.llen("demo") == 0  # nothing in a Redis list
        assert "CONVEYOR_BROKER_URL" in caplog.text
        platform.relay().tick()
        assert _ready(platform) == before + 2
    finally:
        stray.close()
