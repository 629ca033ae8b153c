"""``conveyor probe worker`` against a real prefork worker: it passes while the consumer's
loop runs (also while every pool slot is busy), fails once the worker's main process is
stopped (SIGSTOP: nothing it runs, not even the metrics thread, can tick), passes again
on SIGCONT, and fails when no worker runs. With ``--live`` (the liveness probe) it also
passes while the worker waits for its broker, however long the outage; only readiness
follows the broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import service_env, start_worker, stop
from conveyor.worker.loop_probe import workers
from tests.fault.conftest import wait_ready
from tests.fault.servers import private_redis
from tests.helpers import bound_to, cancelling_leftovers, eventually

pytestmark = [pytest.mark.timeout(90), pytest.mark.fault]

MAX_AGE = 3.0


def probe(home: Path, platform: Any, *, live: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the probe as a container would: a fresh ``conveyor`` process (``live``: the
    liveness probe's ``--live``)."""
    env = service_env(platform.settings, {"CONVEYOR_HOME": str(home)})
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "probe", "worker", "--max-age", str(MAX_AGE), *["--live"][:live]],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def probe_until(
    home: Path, platform: Any, code: int, timeout: float = 15.0
) -> subprocess.CompletedProcess[str]:
    """Probe until it exits with ``code`` or ``timeout`` passes; the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe(home, platform)
        if result.returncode == code or time.monotonic() > deadline:
            return result
        time.sleep(0.3)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home of this test's own: only its worker writes ticks there."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def worker_proc(platform: Any, home: Path, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / "worker.log"
    settings = platform.settings.model_copy(update={"home": home})
    proc = start_worker(settings, queues=["demo"], concurrency=1, log_path=log)
    try:
        wait_ready(log, proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            stop(proc, timeout=15)


def test_probe_fails_without_a_worker(platform: Any, home: Path) -> None:
    result = probe(home, platform)
    assert result.returncode == 1
    assert "no running worker" in result.stderr


def test_probe_follows_the_consumer_loop(
    platform: Any, home: Path, worker_proc: subprocess.Popen[bytes], tag: str
) -> None:
    healthy = probe_until(home, platform, 0)
    assert healthy.returncode == 0, healthy.stderr + healthy.stdout
    assert f"pid {worker_proc.pid}" in healthy.stdout

    # The only pool slot busy for longer than the allowed age: the loop still ticks.
    job = platform.submit("conveyor.demo.effect", {"note": tag, "sleep": MAX_AGE + 3})
    deadline = time.monotonic() + 20
    while job.row()["status"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.row()["status"] == "running"
    time.sleep(MAX_AGE + 1)
    busy = probe(home, platform)
    assert busy.returncode == 0, busy.stderr

    # The main process stopped (its children run on): the consumer is stuck.
    os.kill(worker_proc.pid, signal.SIGSTOP)
    stuck = probe_until(home, platform, 1, timeout=MAX_AGE + 10)
    assert stuck.returncode == 1, stuck.stdout
    assert "consumer event loop stuck" in stuck.stderr
    assert f"pid {worker_proc.pid}" in stuck.stderr
    dead = probe(home, platform, live=True)  # a stuck loop is what liveness is for
    assert dead.returncode == 1 and f"pid {worker_proc.pid}" in dead.stderr, dead.stdout

    os.kill(worker_proc.pid, signal.SIGCONT)
    again = probe_until(home, platform, 0)
    assert again.returncode == 0, again.stderr
    assert job.wait(timeout=30) == "succeeded"

    # A clean stop removes the worker's tick file: nothing left to vouch for.
    assert stop(worker_proc, timeout=15) == 0
    gone = probe(home, platform)
    assert gone.returncode == 1 and "no running worker" in gone.stderr


@pytest.mark.redis_broker
def test_liveness_outlasts_a_broker_outage(platform: Any, home: Path, tmp_path: Path, tag: str) -> None:
    """The kubernetes liveness probe (``--live --max-age 60``) failed 52 s into a broker
    outage, which would restart every worker at once. Here the broker (a private Redis) is
    away for over three times ``--max-age`` (11 s against 3 s: 90 s against 60 s would be 1.5
    times): liveness passes throughout, while the worker waits for it; readiness fails
    meanwhile and passes again once it consumes."""
    server = private_redis()
    log = tmp_path / "worker.log"
    settings = platform.settings.model_copy(update={"home": home}).with_urls(
        server.url, platform.settings.database_url
    )
    proc = start_worker(settings, queues=["demo"], concurrency=1, log_path=log)
    try:
        wait_ready(log, proc)
        assert probe_until(home, platform, 0).returncode == 0
        gone = time.monotonic()
        server.stop()
        # kombu tries the broker again 2, 6, 12 and 20 s after its first miss (the moment the
        # worker's tick first says so): back just before the try at 12 s.
        eventually(lambda: [w.state for w in workers(home)] == ["waiting for the broker"], timeout=10)
        missed = time.monotonic()
        lives, readiness = [], []
        while time.monotonic() - missed < 9.5:
            lives.append(probe(home, platform, live=True))
            readiness.append(probe(home, platform).returncode)
        assert [r.returncode for r in lives] == [0] * len(lives), [r.stderr for r in lives if r.returncode]
        assert len(lives) >= 3 and proc.poll() is None
        assert readiness[-1] == 1, readiness  # not consuming: waiting for the broker
        server.start()
        assert time.monotonic() - gone > 3 * MAX_AGE
        back = probe_until(home, platform, 0, timeout=40)
        assert back.returncode == 0, back.stderr
        with (
            bound_to(platform, platform.settings.database_url, redis_url=server.url),
            cancelling_leftovers(platform),
        ):
            job = platform.submit("conveyor.demo.effect", {"note": tag})
            assert job.wait(timeout=30) == "succeeded"
    finally:
        stop(proc, timeout=15)
        server.stop()
