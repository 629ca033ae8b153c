"""RabbitMQ outages on a private node (its own port and data, a non-guest user): the node
stopped, killed, replaced by an empty one, a queue deleted under load. Every accepted job
ends terminal once, with one effect."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn
from tests.helpers import eventually
from tests.rabbit.conftest import Cluster
from tests.rabbit_support import ctl, queue_stats

pytestmark = pytest.mark.rabbitmq


def _start(spawn: Spawn, cluster: Cluster, concurrency: int = 2, **env: str) -> Any:
    return spawn(concurrency=concurrency, settings=cluster.settings, env=env or None)


def test_a_worker_holds_at_most_one_unacknowledged_delivery_per_slot(
    spawn: Spawn, cluster: Cluster, tag: str
) -> None:
    """Two queues with a backlog and two pool slots: each queue's consumer may hold as many
    as the pool has slots, so RabbitMQ alone would let the worker hold four the whole time;
    Conveyor's gate keeps it at two (rabbitmqctl's counts, refreshed every 250 ms here)."""
    handles = cluster.submit(tag, 16, sleep=0.5)
    writes = [
        cluster.client.submit("conveyor.demo.write", {"user": f"{tag}-u{i}", "note": f"{tag}-w{i}"})
        for i in range(6)
    ]
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            stats = queue_stats(cluster.node.vhost, node=cluster.node.name)
            seen.append(sum(unacked for _, unacked in stats.values()))

    _start(spawn, cluster)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        cluster.all_once(handles, tag)
        for handle in writes:
            assert handle.wait(60) == s.SUCCEEDED
    finally:
        done.set()
        sampler.join(timeout=10)
    assert len(seen) >= 5 and max(seen) >= 1, seen
    # A burst the broker pushed before the gate's cancel arrived (at start, or as queues
    # resume) is handed back within a round trip: seen in at most two passing snapshots,
    # each followed by one within the gate. (rabbitmqctl is slow, so a run may take as few
    # as five snapshots: a share of them would fail on one such burst.)
    over = [i for i, n in enumerate(seen) if n > 2]
    assert len(over) <= 2 and all(i + 1 >= len(seen) or seen[i + 1] <= 2 for i in over), seen


@pytest.mark.parametrize("outage", ["stop", "kill"])
def test_a_node_stopped_or_killed_under_load_loses_no_job(
    spawn: Spawn, cluster: Cluster, tag: str, outage: str
) -> None:
    """Quorum queues keep their messages on disk: after the node is back the workers
    reconnect, the unacked deliveries of the lost connections come back, and the jobs
    that ran meanwhile are not run again."""
    _start(spawn, cluster)
    handles = cluster.submit(tag, 30, sleep=0.2)
    eventually(lambda: sum(cluster.effects(f"{tag}-{i}") for i in range(30)) >= 6, timeout=60)
    getattr(cluster.node, outage)()
    started = time.monotonic()
    more = cluster.submit(f"{tag}-down", 5)  # accepted while the broker is away: the relay sends them
    assert time.monotonic() - started < 3.0  # a submit gives RabbitMQ a second, then moves on
    time.sleep(2)
    cluster.node.start()
    cluster.all_once(handles, tag)
    cluster.all_once(more, f"{tag}-down")


def test_a_node_that_lost_its_data_gets_every_waiting_job_again(
    spawn: Spawn, cluster: Cluster, tag: str
) -> None:
    """The same address comes back as an empty broker (a node replaced): the epoch's marker
    queue is gone, so the relay makes a new epoch and publishes every waiting job again."""
    _start(spawn, cluster, concurrency=1)
    redis = cluster.client.connections.redis
    first = cluster.client.submit("conveyor.demo.effect", {"note": f"{tag}-0", "barrier": f"{tag}-b"})
    eventually(lambda: redis.llen(f"{tag}-b:started") == 1, timeout=60)
    rest = [cluster.client.submit("conveyor.demo.effect", {"note": f"{tag}-{i}"}) for i in range(1, 12)]
    time.sleep(1)  # the rest is queued in RabbitMQ behind the one slot
    cluster.node.wipe()
    cluster.node.start(first=True)
    redis.rpush(f"{tag}-b:go", "go")
    cluster.all_once([first, *rest], tag)


def test_a_queue_deleted_under_load_loses_no_job(spawn: Spawn, cluster: Cluster, tag: str) -> None:
    """Deleting a queue drops its messages without a trace in the broker. The workers'
    consumers are cancelled, they reconnect and declare it again; the jobs whose messages
    went with it are found by the unclaimed-too-long rule (the queue holds fewer messages
    than it has waiting jobs) and published again."""
    _start(spawn, cluster, CONVEYOR_REPUBLISH_AFTER="2")
    handles = cluster.submit(tag, 40, sleep=0.1)
    eventually(lambda: sum(cluster.effects(f"{tag}-{i}") for i in range(40)) >= 5, timeout=60)
    ctl("delete_queue", "-p", cluster.node.vhost, "demo", node=cluster.node.name)
    cluster.all_once(handles, tag, timeout=120)


def test_a_worker_started_before_its_broker_waits_for_it(spawn: Spawn, cluster: Cluster, tag: str) -> None:
    """Kubernetes starts pods in no order: a worker whose RabbitMQ is still booting keeps
    trying (Celery's reconnect, and Conveyor's start-up reads the epoch later)."""
    from conveyor.delivery.procs import start_worker, stop
    from tests.fault.conftest import wait_ready

    cluster.node.stop()
    log = cluster.node.dir.parent / f"{tag}-early-worker.log"
    proc = start_worker(cluster.settings, queues=["demo"], concurrency=1, log_path=log)
    try:
        time.sleep(4)
        assert proc.poll() is None, log.read_text()[-2000:]
        cluster.node.start()
        wait_ready(log, proc)
        handles = cluster.submit(tag, 3)
        cluster.all_once(handles, tag)
    finally:
        stop(proc, timeout=10)
        log.unlink(missing_ok=True)
