"""Solo and thread pools run jobs in the worker's own process: leases are renewed for every
running job, an interrupt never ends the worker, and a bounded SIGTERM requeues and exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import start_worker, stop
from conveyor.store.db import schema as s
from conveyor.store.jobs import counted_attempts
from conveyor.worker.heartbeat import INTERRUPT_SIGNAL
from tests.fault.conftest import Spawn, wait_ready
from tests.helpers import effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


@pytest.fixture
def pool_worker(platform: Any, tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(pool: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{pool}-{len(procs)}.log"
        proc = start_worker(
            platform.settings,
            queues=[q.name for q in platform.queues],
            concurrency=2,
            log_path=log,
            extra_env=env,
            extra_args=["-P", pool],
        )
        procs.append(proc)
        wait_ready(log, proc)
        return proc

    yield start
    for proc in procs:
        stop(proc, timeout=5, sig=signal.SIGKILL)


def test_thread_pool_renews_every_running_jobs_lease(platform: Any, pool_worker: Any, tag: str) -> None:
    pool_worker("threads")
    handles = [platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", "sleep": 7}) for i in range(2)]
    for handle in handles:  # the suite's lease is 3 s: both outlive it twice
        assert handle.wait(60) == s.SUCCEEDED
        assert handle.row()["attempts"] == 1
        assert "job.stalled" not in [e.topic for e in handle.events()[0]]


def test_interrupt_for_a_thread_pool_job_never_ends_the_worker(
    platform: Any, pool_worker: Any, tag: str
) -> None:
    worker = pool_worker("threads")
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": 3})
    row = eventually(lambda: (r := job_row(platform, handle.id))["status"] == s.RUNNING and r, timeout=60)
    arguments = {"job_id": handle.id, "attempt": row["attempts"], "task_id": row["celery_task_id"]}
    platform.app.control.broadcast("conveyor_interrupt", arguments=arguments, reply=True, timeout=5)
    os.kill(worker.pid, INTERRUPT_SIGNAL)  # and a stray one at the worker itself
    assert handle.wait(60) == s.SUCCEEDED
    assert worker.poll() is None


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_bounded_sigterm_of_an_in_process_pool_requeues_uncounted(
    platform: Any, pool_worker: Any, spawn: Spawn, pool: str, tag: str
) -> None:
    worker = pool_worker(pool, {"CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "2"})
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": 10})  # soft limit: 15 s
    eventually(lambda: job_row(platform, handle.id)["status"] == s.RUNNING, timeout=60)
    sent = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert time.monotonic() - sent < 10
    row = handle.row()
    assert row["status"] == s.QUEUED and row["uncounted"] == 1 and row["requeues"] == 1
    spawn()
    assert handle.wait(90) == s.SUCCEEDED
    assert counted_attempts(handle.row()) == 1 and effect_count(platform, note=tag) == 1
