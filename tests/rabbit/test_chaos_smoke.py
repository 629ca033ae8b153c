"""A 200-job chaos smoke on RabbitMQ: a stream of jobs through two prefork workers while
the run SIGKILLs a worker's process group, a pool child, SIGTERMs a worker, and kills and
restarts the broker node. Every accepted job ends succeeded, with exactly one effect."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import pytest

from conveyor.store.db import schema as s
from tests.chaos.cluster import child_pids
from tests.fault.conftest import Spawn
from tests.rabbit.conftest import Cluster

pytestmark = [pytest.mark.rabbitmq, pytest.mark.fault]

JOBS = int(os.environ.get("CHAOS_JOBS", "200"))


def test_two_hundred_jobs_survive_kills_and_a_broker_restart(
    spawn: Spawn, cluster: Cluster, tag: str
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", str(random.randrange(1 << 30))))
    print(f"CHAOS_SEED={seed}")
    rng = random.Random(seed)
    workers = [spawn(concurrency=2, settings=cluster.settings) for _ in range(2)]
    handles: list[Any] = []
    submitted = threading.Event()

    def submit() -> None:
        for i in range(JOBS):
            sleep = rng.choice([0.0, 0.05, 0.2])
            handles.append(
                cluster.client.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", "sleep": sleep})
            )
            time.sleep(0.02)
        submitted.set()

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    faults = ["group", "child", "sigterm", "node"]
    rng.shuffle(faults)
    for fault in faults:
        time.sleep(rng.uniform(0.5, 1.5))
        victim = rng.randrange(len(workers))
        proc = workers[victim]
        print(f"fault {fault} on worker {victim}")
        if fault == "group":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            workers[victim] = spawn(concurrency=2, settings=cluster.settings)
        elif fault == "child":
            for pid in list(child_pids(proc.pid))[:1]:
                os.kill(pid, signal.SIGKILL)
        elif fault == "sigterm":
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
            workers[victim] = spawn(concurrency=2, settings=cluster.settings)
        else:
            cluster.node.kill()
            time.sleep(1)
            cluster.node.start()
    assert submitted.wait(120)
    cluster.all_once(handles, tag, timeout=180)
    assert all(h.row()["status"] == s.SUCCEEDED for h in handles)
