"""A dead worker's jobs come back fast; an unreachable service never reads as a dead worker.

These run the lease, heartbeat and reconciler timers at their defaults (the suite's fast
timers would hide the promise under test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.db import schema as s
from conveyor.db.dialect import db_now
from conveyor.procs import service_env
from conveyor.settings import ConveyorSettings
from conveyor.store import counted_attempts
from tests.fault.conftest import Spawn, children, kill_group
from tests.fault.servers import PrivateRedis, private_redis
from tests.fault.test_shutdown import open_barrier, started
from tests.helpers import effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]

TIMERS = ("lease_timeout", "heartbeat_interval", "reconciler_interval", "relay_interval", "republish_after")
# The settings' own defaults, whatever they are (the suite's environment sets fast ones).
DEFAULT_TIMERS = {f"CONVEYOR_{n.upper()}": str(ConveyorSettings.model_fields[n].default) for n in TIMERS}


def _db_now(platform: Any) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(db_now())).scalar_one()


def test_message_taken_by_a_worker_killed_before_its_claim_runs_within_30s(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    first = spawn(concurrency=1, env=DEFAULT_TIMERS)
    (child,) = eventually(lambda: children(first.pid), timeout=30)
    os.kill(child, signal.SIGSTOP)  # it will take the next message and never claim it
    handle = platform.submit("conveyor.demo.effect", {"note": tag})
    r = platform.redis
    prefix = platform.settings.key_prefix

    def delivered() -> bool:
        workers = [w.decode() for w in r.hkeys(f"{prefix}workers")]
        return any(r.zscore(f"{prefix}delivered:{w}", handle.id) is not None for w in workers)

    eventually(delivered, timeout=30)
    killed_at = _db_now(platform)
    kill_group(first)
    spawn(env=DEFAULT_TIMERS)
    assert handle.wait(60) == s.SUCCEEDED
    row = handle.row()
    assert (row["started_at"] - killed_at).total_seconds() < 30
    assert counted_attempts(row) == 1 and effect_count(platform, note=tag) == 1


def test_dead_workers_running_job_is_taken_over_by_the_lease_path_within_15s(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    env = {**DEFAULT_TIMERS, "CONVEYOR_DETECT_LOCAL_DEAD_OWNERS": "false"}
    doomed = spawn(concurrency=1, env=env)
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    started(platform, tag)
    spawn(env=env)  # a live worker, whose relay keeps running
    killed_at = _db_now(platform)
    kill_group(doomed)
    open_barrier(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    row = handle.row()
    recovery = (row["started_at"] - killed_at).total_seconds()
    print(f"recovery_s_lease={recovery:.2f}")
    assert recovery <= 15
    assert row["attempts"] == 2 and counted_attempts(row) == 2  # a crash counts
    assert effect_count(platform, note=tag) == 1


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = private_redis()
    yield server
    server.stop()


SUBMIT = """
import json, sys
from config.celery_app import platform
print(json.dumps(platform.submit(sys.argv[1], json.loads(sys.argv[2])).id), flush=True)
"""


def _submit(settings: Any, stage: str, payload: dict[str, Any]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SUBMIT, stage, json.dumps(payload)],
        env=service_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return str(json.loads(out.strip().splitlines()[-1]))


def test_redis_down_longer_than_a_lease_takes_nothing_over(
    platform: Any, spawn: Spawn, redis_server: PrivateRedis, tag: str
) -> None:
    """The suite's lease is 3 s; Redis stays down for 8 s while the job runs."""
    settings = platform.settings.with_urls(redis_server.url, platform.settings.database_url)
    spawn(settings=settings)
    job_id = _submit(settings, "conveyor.demo.effect", {"note": tag, "sleep": 12})
    eventually(lambda: job_row(platform, job_id)["status"] == s.RUNNING, timeout=60)
    redis_server.shutdown_nosave()
    time.sleep(8)
    redis_server.start()
    row = eventually(lambda: (r := job_row(platform, job_id))["status"] in s.TERMINAL and r, timeout=90)
    assert row["status"] == s.SUCCEEDED
    assert row["attempts"] == 1 and row["uncounted"] == 0
    assert effect_count(platform, note=tag) == 1
