"""RabbitMQ's consumer timeout: a channel holding a delivery unacked longer is closed by
the broker and the message goes back to its queue while its job still runs. Conveyor keeps
every time limit below ``broker_consumer_timeout`` (tests/unit/test_config.py); here the
setting lies (the node's is 2 s), and the job still ends once, with one effect."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn
from tests.rabbit.conftest import Cluster

pytestmark = [pytest.mark.rabbitmq, pytest.mark.fault]

NODE_OPTIONS: dict[str, Any] = {"consumer_timeout_ms": 2000}


def test_a_job_outliving_the_consumer_timeout_still_ends_once(
    spawn: Spawn, cluster: Cluster, tag: str
) -> None:
    worker = spawn(concurrency=1, settings=cluster.settings)
    handle = cluster.client.submit("conveyor.demo.effect", {"note": tag, "sleep": 5})
    after = cluster.client.submit("conveyor.demo.effect", {"note": f"{tag}-after"})
    assert handle.wait(90) == s.SUCCEEDED
    assert after.wait(60) == s.SUCCEEDED
    assert cluster.effects(tag) == 1 and cluster.effects(f"{tag}-after") == 1
    assert worker.poll() is None  # the closed channel ended no worker
