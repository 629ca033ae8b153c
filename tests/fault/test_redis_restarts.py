"""Redis restarted again and again under busy prefork workers: no worker's main process
ever exits, and every job still succeeds with exactly one effect.

Celery 5.7's ``on_connection_error_after_connected`` crashed the worker ("Unrecoverable
error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")") when the
connection dropped while a delivery was unacknowledged and a BRPOP pending;
``conveyor.worker.consumer.Consumer`` contains that. Each variant restarts a private Redis ten
times, alternating SIGTERM (a clean shutdown) with SIGKILL, always with deliveries in
flight: once without persistence (every restart wipes the queues) and once with
``appendonly yes``.

Runtime: Celery's reconnect waits (2 s, then 2 s more per failed attempt) are fixed in
``Consumer.ensure_connected``, no setting shortens them; the outages are kept short so that
most reconnects succeed at the first or second attempt (about 25 s per variant).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.delivery.procs import service_env
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from tests.fault.conftest import Spawn
from tests.fault.servers import PrivateRedis, private_redis
from tests.fault.test_outages import _effects_per_note
from tests.helpers import eventually

pytestmark = [pytest.mark.timeout(150), pytest.mark.fault]

# Jobs submitted before each restart, over two workers of three pool slots: as a rule some
# worker then holds an unacknowledged delivery *and* has a BRPOP in flight for a free slot,
# the state in which Celery 5.7 crashed (deploy/upstream/celery-redis-restart.md).
BATCH = 4
CONCURRENCY = 3
SLEEP = 1.0  # seconds each job runs, so that every restart finds deliveries in flight
# Seconds Redis stays away at each of the ten restarts: mostly a quick restart, twice half a
# second, once long enough that the worker's first reconnect attempts are refused.
OUTAGES = (0.0, 0.0, 0.5, 0.0, 0.0, 3.0, 0.0, 0.0, 0.5, 0.0)
RECEIVED = re.compile(r"Task conveyor\.demo\.effect\[[^\]]+\] received")

SUBMITTER = """
import json, sys
from config.celery_app import platform
tag, sleep, count = sys.argv[1], float(sys.argv[2]), 0
for line in sys.stdin:
    notes = [f"{tag}-{count + i}" for i in range(int(line))]
    count += len(notes)
    ids = [platform.submit("conveyor.demo.effect", {"note": n, "sleep": sleep}).id for n in notes]
    print(json.dumps(ids), flush=True)
"""


@pytest.fixture(params=["volatile", "appendonly"])
def redis_server(request: pytest.FixtureRequest) -> Iterator[PrivateRedis]:
    server = private_redis(appendonly=request.param == "appendonly")
    yield server
    server.destroy()


class Submitter:
    """One long-lived process that submits jobs on request (imports once, not per batch)."""

    def __init__(self, settings: Any, tag: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SUBMITTER, tag, str(SLEEP)],
            env=service_env(settings),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def submit(self, n: int) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"submitter exited with {self.proc.wait(timeout=10)}"
        return list(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _alive(workers: list[subprocess.Popen[bytes]], logs: list[Path]) -> bool:
    """Every worker's main process is running and none logged Celery's fatal error."""
    exited = [w.returncode for w in workers if w.poll() is not None]
    crashed = [log.name for log in logs if "Unrecoverable error" in log.read_text(errors="replace")]
    assert not exited and not crashed, f"worker exit codes {exited}; 'Unrecoverable error' in {crashed}"
    return True


def _received(logs: list[Path]) -> int:
    return sum(len(RECEIVED.findall(log.read_text(errors="replace"))) for log in logs)


def _statuses(engine: Any, ids: list[str]) -> dict[str, int]:
    with engine.connect() as conn:
        q = select(jobs.c.status, func.count()).where(jobs.c.id.in_(ids)).group_by(jobs.c.status)
        return {str(st): int(n) for st, n in conn.execute(q)}


def _all_terminal(engine: Any, ids: list[str]) -> dict[str, int]:
    statuses = _statuses(engine, ids)
    return statuses if sum(statuses.get(t, 0) for t in s.TERMINAL) == len(ids) else {}


def _restart(server: PrivateRedis, i: int) -> None:
    """Even restarts: SIGTERM (a clean shutdown, the AOF flushed); odd ones: SIGKILL."""
    if i % 2:
        server.stop()
    else:
        server.terminate()
    time.sleep(OUTAGES[i])
    server.start()


def test_redis_restarts_with_jobs_in_flight_never_end_a_worker(
    platform: Any, spawn: Spawn, redis_server: PrivateRedis, tag: str, tmp_path: Path
) -> None:
    settings = platform.settings.with_urls(redis_server.url, platform.settings.database_url)
    workers = [spawn(settings=settings, concurrency=CONCURRENCY) for _ in range(2)]
    logs = sorted(tmp_path.glob("worker-*.log"))
    submitter = Submitter(settings, tag)
    ids: list[str] = []
    for i in range(len(OUTAGES)):
        seen = _received(logs)
        ids += submitter.submit(BATCH)
        # The workers are connected again and hold the batch: unacknowledged, running.
        eventually(lambda seen=seen: _alive(workers, logs) and _received(logs) >= seen + BATCH, timeout=30)
        eventually(lambda ids=ids: _statuses(platform.engine, ids).get(s.RUNNING, 0), timeout=10)
        _restart(redis_server, i)
    submitter.close()
    done = eventually(lambda: _alive(workers, logs) and _all_terminal(platform.engine, ids), timeout=60)
    assert _alive(workers, logs)
    assert done == {s.SUCCEEDED: len(ids)}
    assert _effects_per_note(platform.engine, tag) == {f"{tag}-{i}": 1 for i in range(len(ids))}
