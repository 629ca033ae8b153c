"""The one window a random schedule rarely hits: a worker has taken a message from Redis
(BRPOP popped it) but has not claimed its job (nor logged it, nor recorded the delivery)
when it is SIGKILLed. The job must still run within 30 s of the kill.

The window is opened on purpose: the idle worker's main process waits in BRPOP, is
SIGSTOPped, a job is submitted (Redis hands the message to the stopped client and drops
it from the list), and the worker's process group is SIGKILLed. Default timers.

``tests/fault/test_lost_workers.py`` stops the pool *child* instead, after the main process
received the message and recorded the delivery; here nothing was recorded yet (kombu had
not even put the message in its ``unacked`` hash). The chaos runs hit this window by
chance: a worker killed while its BRPOP for a free slot was being answered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from conveyor.delivery.procs import service_env
from tests.chaos.checker import db_now
from tests.chaos.cluster import Cluster, default_timer_env, wait_gone
from tests.fault.servers import PrivateRedis, private_redis

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

BOUND_S = 30.0
# Imports first, then one submit per line read: the push must follow the SIGSTOP within
# kombu's BRPOP timeout (1 s), or Redis answers the stopped client with nothing instead.
SUBMIT = """
import sys
from config.celery_app import platform
platform.broker.epoch()
print("READY", flush=True)
for line in sys.stdin:
    print(platform.submit("conveyor.demo.effect", {"note": line.strip()}).id, flush=True)
"""
TRIES = 5


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = private_redis()
    yield server
    server.stop()


def _queued_messages(server: PrivateRedis) -> int:
    client = server.client()
    return sum(int(client.llen(k)) for k in client.keys("demo*") if client.type(k) == b"list")


def _claimed_at(engine: Any, job_id: str) -> Any:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT attempts, started_at, status FROM jobs WHERE id = :id"), {"id": job_id}
        ).one()
    return row.started_at if row.attempts > 0 else None


def test_message_taken_before_claim_runs_within_30s_of_the_kill(
    platform: Any, tmp_path: Path, redis_server: PrivateRedis, tag: str
) -> None:
    settings = platform.settings.with_urls(redis_server.url, platform.settings.database_url)
    cluster = Cluster(
        settings,
        queues=[q.name for q in platform.queues],
        log_dir=tmp_path,
        env=default_timer_env(),
        concurrency=1,
    )
    submitter = subprocess.Popen(
        [sys.executable, "-c", SUBMIT],
        env=service_env(settings),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert submitter.stdin is not None and submitter.stdout is not None
    try:
        assert submitter.stdout.readline().strip() == "READY"
        inc = cluster.start("A")
        for attempt in range(1, TRIES + 1):
            time.sleep(1.5)  # idle: its main process waits in BRPOP on the queues
            os.kill(inc.proc.pid, signal.SIGSTOP)
            submitter.stdin.write(f"{tag}-{attempt}\n")
            submitter.stdin.flush()
            job_id = submitter.stdout.readline().strip()
            time.sleep(0.5)
            taken = _queued_messages(redis_server) == 0
            in_unacked = any(job_id.encode() in v for v in redis_server.client().hgetall("unacked").values())
            print(
                f"\ntry {attempt}: job {job_id} popped from the queue by the stopped worker: {taken}; "
                f"in kombu's unacked hash: {in_unacked}",
                flush=True,
            )
            if taken:
                break
            os.kill(inc.proc.pid, signal.SIGCONT)  # it runs that job; try again with the next
            assert platform.job(job_id).wait(60) == "succeeded"
        else:
            pytest.skip(f"the stopped worker never took the message in {TRIES} tries")
        at = db_now(platform.engine)
        pids = inc.pids()
        inc.signalled = "group"
        os.killpg(inc.proc.pid, signal.SIGKILL)
        inc.proc.wait(timeout=10)
        wait_gone(pids)
        cluster.start("A")
        deadline = time.monotonic() + BOUND_S + 5
        claimed = None
        while claimed is None and time.monotonic() < deadline:
            claimed = _claimed_at(platform.engine, job_id)
            time.sleep(0.25)
        waited = (claimed - at).total_seconds() if claimed is not None else None
        shown = "never" if waited is None else f"{waited:.2f}s"
        print(f"kill to claim: {shown} (bound {BOUND_S}s)", flush=True)
        if claimed is None:
            with platform.engine.connect() as conn:
                row = conn.execute(
                    text(
                        "SELECT status, attempts, celery_task_id, published_at, broker_epoch FROM jobs "
                        "WHERE id = :id"
                    ),
                    {"id": job_id},
                ).one()
            print(f"job row {BOUND_S + 5:.0f}s after the kill: {row._asdict()}", flush=True)
        assert waited is not None and waited <= BOUND_S, (
            f"a message taken (popped) by a worker killed before its claim: claimed {shown} after "
            f"the kill (bound {BOUND_S}s)"
        )
        assert platform.job(job_id).wait(60) == "succeeded"
    finally:
        submitter.kill()
        submitter.wait(timeout=10)
        submitter.stdin.close()
        submitter.stdout.close()
        for i in cluster.every:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(i.proc.pid, signal.SIGCONT)
        cluster.stop_all()
