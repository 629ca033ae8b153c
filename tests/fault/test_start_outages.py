"""A process started while Redis or Postgres is unreachable waits for it, saying what it
waits for (never the password), then runs; it never exits for an outage. A Redis that
may evict keys is still refused, once it answers (issue #27, item 1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.delivery.embedded import free_port
from conveyor.delivery.procs import start_worker, stop
from conveyor.store.db.engine import make_engine
from conveyor.store.db.schema import stages
from tests.fault.conftest import wait_ready
from tests.fault.servers import PrivatePostgres, PrivateRedis, private_postgres
from tests.helpers import bound_to, cancelling_leftovers, eventually

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault, pytest.mark.redis_broker]

PASSWORD = "s3cr3t-start-wait"


def said(log: Path, pattern: str, proc: subprocess.Popen[Any], count: int = 1, timeout: float = 60) -> str:
    """The log once ``pattern`` (a regex) appears in it ``count`` times; fails if the process
    exits first."""

    def seen() -> str:
        text = log.read_text() if log.exists() else ""
        assert proc.poll() is None, f"exited with {proc.returncode} while waiting:\n{text[-3000:]}"
        return text if len(re.findall(pattern, text)) >= count else ""

    return str(eventually(seen, timeout=timeout, interval=0.1))


@pytest.fixture
def down_redis() -> Iterator[PrivateRedis]:
    """A Redis that is not running yet (its port free), with a password."""
    server = PrivateRedis(free_port(), password=PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def down_postgres() -> Iterator[PrivatePostgres]:
    """A migrated Postgres, stopped."""
    from config.migrations import upgrade

    server = private_postgres()
    engine = make_engine(server.url, pool_size=1)
    upgrade(engine)
    engine.dispose()
    server.stop("immediate")
    yield server
    server.destroy()


def test_worker_waits_for_redis_then_postgres_then_runs(
    platform: Any, down_redis: PrivateRedis, down_postgres: PrivatePostgres, tmp_path: Path, tag: str
) -> None:
    settings = platform.settings.with_urls(down_redis.url, down_postgres.url)
    log = tmp_path / "worker.log"
    proc = start_worker(settings, queues=["demo"], concurrency=1, log_path=log)
    try:
        shown = f"redis://127.0.0.1:{down_redis.port}/0"
        # Still there after its second try: it waits, it does not exit.
        text = said(log, re.escape(f"waiting for Redis at {shown}"), proc, count=2)
        assert PASSWORD not in text
        down_redis.start()
        database = f"postgresql://postgres@127.0.0.1:{down_postgres.port}/postgres"
        text = said(log, re.escape(f"waiting for Postgres at {database}"), proc, count=2)
        assert " ready." not in text  # it waits before it consumes
        down_postgres.start()
        wait_ready(log, proc)
        text = log.read_text()
        assert PASSWORD not in text
        assert f"Redis at {shown} answers" in text and f"Postgres at {database} answers" in text
        # The stage registry was written once Postgres answered, not skipped.
        engine = make_engine(down_postgres.url, pool_size=1)
        with engine.connect() as conn:
            names = set(conn.execute(select(stages.c.name)).scalars())
        engine.dispose()
        assert "conveyor.demo.effect" in names
        with bound_to(platform, down_postgres.url, redis_url=down_redis.url), cancelling_leftovers(platform):
            job = platform.submit("conveyor.demo.effect", {"note": tag})
            assert job.wait(timeout=60) == "succeeded"
    finally:
        stop(proc, timeout=15)


def test_worker_still_refuses_an_evicting_redis_once_it_answers(platform: Any, tmp_path: Path) -> None:
    server = PrivateRedis(free_port(), policy="allkeys-lru")
    settings = platform.settings.with_urls(server.url, platform.settings.database_url)
    log = tmp_path / "worker.log"
    proc = start_worker(settings, queues=["demo"], concurrency=1, log_path=log)
    try:
        said(log, re.escape(f"waiting for Redis at {server.url}"), proc)
        server.start()
        assert proc.wait(timeout=60) != 0  # a supervisor restarting on failure restarts it
        assert "maxmemory-policy is 'allkeys-lru'" in log.read_text()
    finally:
        stop(proc, timeout=15)
        server.stop()


def test_up_waits_for_postgres(down_postgres: PrivatePostgres, tmp_path: Path) -> None:
    """``conveyor up`` on configured services migrates once Postgres answers (``demo`` waits
    the same way: both migrate through ``cli_common.migrate``)."""
    from tests.fault.servers import private_redis

    redis_server = private_redis()
    env = {
        **os.environ,
        "CONVEYOR_HOME": str(tmp_path),
        "CONVEYOR_HTTP_PORT": "0",
        "CONVEYOR_REDIS_URL": redis_server.url,
        "CONVEYOR_DATABASE_URL": down_postgres.url,
    }
    env.pop("CONVEYOR_BROKER_URL", None)
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "up", "--concurrency", "1"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        database = f"postgresql://postgres@127.0.0.1:{down_postgres.port}/postgres"
        said(out, re.escape(f"waiting for Postgres at {database}"), up, count=2)
        down_postgres.start()
        said(out, "conveyor up.*: redis", up)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
            redis_server.stop()
    assert up.returncode == 0, out.read_text()[-3000:]
