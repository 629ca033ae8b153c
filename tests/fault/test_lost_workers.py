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
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.delivery.procs import service_env
from conveyor.settings import ConveyorSettings
from conveyor.store.db import schema as s
from conveyor.store.db.schema import job_events
from conveyor.store.jobs import counted_attempts
from tests.fault.conftest import Spawn, children, kill_group
from tests.fault.servers import PrivateRedis, private_redis
from tests.fault.test_shutdown import open_barrier, started
from tests.helpers import database_now, effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]

TIMERS = ("lease_timeout", "heartbeat_interval", "reconciler_interval", "relay_interval", "republish_after")
# The settings' own defaults, whatever they are (the suite's environment sets fast ones).
DEFAULT_TIMERS = {f"CONVEYOR_{n.upper()}": str(ConveyorSettings.model_fields[n].default) for n in TIMERS}


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _sole_pool_process(platform: Any, worker: subprocess.Popen[bytes], probe: str) -> int:
    """The pid of ``worker``'s only pool process, proven to be the one that runs its jobs:
    a probe job reports the pid that ran it (the pool is up, and nothing else runs jobs)."""
    open_barrier(platform, probe, n=1)  # the probe passes its barrier at once
    handle = platform.submit("conveyor.demo.effect", {"note": probe, "barrier": probe})
    ran_in = int(started(platform, probe)[0].rsplit(":", 1)[1])
    assert handle.wait(30) == s.SUCCEEDED, _story(platform, handle.id)
    pool = children(worker.pid)
    assert pool == [ran_in], f"pool processes {pool}, the probe ran in {ran_in}"
    return ran_in


def _story(platform: Any, job_id: str, logs: Path | None = None, note: str = "") -> str:
    """A job's row and events (and the workers' logs), for an assertion message."""
    cols = ("status", "attempts", "uncounted", "requeues", "lease_owner", "started_at", "last_error")
    with platform.engine.connect() as conn:
        row = platform.store.get(conn, job_id)
        events = conn.execute(
            select(job_events.c.created_at, job_events.c.topic, job_events.c.body)
            .where(job_events.c.job_id == job_id)
            .order_by(job_events.c.id)
        ).all()
    lines = [f"{note}job {job_id}: " + (", ".join(f"{c}={row[c]}" for c in cols) if row else "missing")]
    lines += [f"  {e.created_at:%H:%M:%S.%f} {e.topic} {json.dumps(e.body)}" for e in events]
    for log in sorted(logs.glob("worker-*.log")) if logs is not None else []:
        lines.append(f"--- {log.name} (tail)")
        lines += [ln for ln in log.read_text().splitlines() if " [" in ln][-40:]
    return "\n".join(lines)


def test_message_taken_by_a_worker_killed_before_its_claim_runs_within_30s(
    platform: Any, spawn: Spawn, tag: str, tmp_path: Path
) -> None:
    first = spawn(concurrency=1, env=DEFAULT_TIMERS)
    child = _sole_pool_process(platform, first, f"{tag}-probe")
    os.kill(child, signal.SIGSTOP)  # it will take the next message and never claim it
    eventually(lambda: _state(child) == "T", timeout=10)
    handle = platform.submit("conveyor.demo.effect", {"note": tag})
    r = platform.redis
    prefix = platform.settings.key_prefix

    def delivered() -> bool:  # to the first worker (its id ends with ":<pid>")
        workers = [w.decode() for w in r.hkeys(f"{prefix}workers") if w.decode().endswith(f":{first.pid}")]
        return any(r.zscore(f"{prefix}delivered:{w}", handle.id) is not None for w in workers)

    eventually(delivered, timeout=30)
    # The premise: the only pool process is stopped and the job was never claimed.
    row = handle.row()
    premise = (children(first.pid), _state(child), row["status"], row["attempts"])
    assert premise == ([child], "T", s.QUEUED, 0), _story(platform, handle.id, tmp_path, f"{premise}: ")
    killed_at = database_now(platform)
    kill_group(first)
    spawn(env=DEFAULT_TIMERS)
    status = handle.wait(60)
    row = handle.row()
    story = _story(platform, handle.id, tmp_path, f"killed at {killed_at:%H:%M:%S.%f}: ")
    assert status == s.SUCCEEDED, story
    assert (row["started_at"] - killed_at).total_seconds() < 30, story
    assert (counted_attempts(row), effect_count(platform, note=tag)) == (1, 1), story


def test_dead_workers_running_job_is_taken_over_by_the_lease_path_within_15s(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    env = {**DEFAULT_TIMERS, "CONVEYOR_DETECT_LOCAL_DEAD_OWNERS": "false"}
    doomed = spawn(concurrency=1, env=env)
    handle = platform.submit("conveyor.demo.effect", {"note": tag, "barrier": tag})
    started(platform, tag)
    spawn(env=env)  # a live worker, whose relay keeps running
    killed_at = database_now(platform)
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
