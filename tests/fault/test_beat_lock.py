"""Two ``conveyor beat`` processes on one database: one fires, the other stands by until
the first is gone (here: SIGKILLed, its lock's session closed by Postgres), then takes
over. The lock's watchdog ends a beat whose lock session is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conveyor.delivery.procs import service_env
from conveyor.upkeep.beat_lock import BEAT_LOCK, BeatLock

pytestmark = [pytest.mark.timeout(90), pytest.mark.fault]

STARTED = "beat: Starting"
STANDING_BY = "standing by"


def _text(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def wait_log(log: Path, proc: subprocess.Popen[bytes], marker: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while marker not in _text(log):
        if proc.poll() is not None:
            raise AssertionError(f"beat exited with {proc.returncode}:\n{_text(log)[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{marker!r} not logged after {timeout}s:\n{_text(log)[-3000:]}")
        time.sleep(0.1)


@pytest.fixture
def beats(platform: Any, tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    """Two ``conveyor beat`` processes, each with a home and log of its own."""
    started = []
    for n in range(2):
        home = tmp_path / f"home{n}"
        home.mkdir()
        log = tmp_path / f"beat{n}.log"
        env = service_env(platform.settings, {"CONVEYOR_HOME": str(home)})
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor", "beat"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        started.append((proc, log))
    yield started
    for proc, _ in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_second_beat_stands_by_until_the_first_is_gone(
    beats: list[tuple[subprocess.Popen[bytes], Path]],
) -> None:
    deadline = time.monotonic() + 30
    while not any(STARTED in _text(log) for _, log in beats) and time.monotonic() < deadline:
        time.sleep(0.1)
    (first, first_log), (second, second_log) = sorted(beats, key=lambda b: STARTED not in _text(b[1]))
    assert STARTED in _text(first_log), _text(first_log)[-3000:]
    wait_log(second_log, second, STANDING_BY)
    time.sleep(3)  # beat would have started by now, were it free to
    assert STARTED not in _text(second_log)

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    t0 = time.monotonic()
    wait_log(second_log, second, STARTED, timeout=15)
    assert time.monotonic() - t0 < 10

    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=15) == 0


def test_watchdog_stops_a_beat_whose_lock_session_is_gone(platform: Any) -> None:
    lock = BeatLock(platform.settings, check=0.2)
    assert lock.try_acquire()
    other = BeatLock(platform.settings)
    try:
        assert not other.try_acquire()
        lost = threading.Event()
        lock.watch(on_lost=lost.set)
        time.sleep(0.5)
        assert not lost.is_set()
        # Postgres ends the lock's session (as when it drops a dead client): the lock is free.
        dsn = other._conn.info.dsn
        with psycopg.connect(dsn, autocommit=True, application_name="test") as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (lock._conn.info.backend_pid,))
        assert lost.wait(5), "the watchdog did not notice"
        assert other.try_acquire()
        held = other._conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()[0]
        assert held == 1, BEAT_LOCK
    finally:
        lock.release()
        other.release()


def test_probe_beat_tells_whether_a_beat_holds_the_lock(platform: Any) -> None:
    env = service_env(platform.settings)
    command = [sys.executable, "-m", "conveyor", "probe", "beat"]
    free = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert free.returncode == 1 and "no beat holds" in free.stderr
    lock = BeatLock(platform.settings)
    assert lock.try_acquire()
    try:
        held = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        assert held.returncode == 0, held.stderr
    finally:
        lock.release()


def test_a_beat_whose_lock_session_ends_stops_firing(
    platform: Any, beats: list[tuple[subprocess.Popen[bytes], Path]]
) -> None:
    """A real ``conveyor beat``: Postgres ends its lock's session (as it does a client it
    finds dead); the beat exits instead of firing on without the lock, and the standby
    takes over."""
    deadline = time.monotonic() + 30
    while not any(STARTED in _text(log) for _, log in beats) and time.monotonic() < deadline:
        time.sleep(0.1)
    (first, first_log), (second, second_log) = sorted(beats, key=lambda b: STARTED not in _text(b[1]))
    wait_log(second_log, second, STANDING_BY)
    url = platform.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True, application_name="test") as admin:
        ended = admin.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objid = %s"
            " AND a.datname = current_database()",
            (BEAT_LOCK & 0xFFFFFFFF,),
        ).fetchall()
    assert ended == [(True,)]
    assert first.wait(timeout=20) == 0, _text(first_log)[-3000:]
    assert "lost the beat lock" in _text(first_log)
    wait_log(second_log, second, STARTED, timeout=15)
