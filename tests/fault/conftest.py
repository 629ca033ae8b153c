"""Fault-test plumbing: real prefork ``celery worker`` subprocesses that can be killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import start_worker, stop
from tests.helpers import cancelling_leftovers

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn(platform: Any, tmp_path: Path) -> Iterator[Spawn]:
    """Start worker subprocesses (all queues, prefork); every one is stopped afterwards,
    and the jobs the test left unfinished are cancelled."""
    procs: list[subprocess.Popen[bytes]] = []

    def _spawn(
        *, concurrency: int = 2, env: dict[str, str] | None = None, settings: Any = None
    ) -> subprocess.Popen[bytes]:
        log = tmp_path / f"worker-{len(procs)}.log"
        proc = start_worker(
            settings or platform.settings,
            queues=[q.name for q in platform.queues],
            concurrency=concurrency,
            log_path=log,
            extra_env=env,
        )
        procs.append(proc)
        wait_ready(log, proc)
        return proc

    with cancelling_leftovers(platform):
        yield _spawn
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            stop(proc, timeout=5)


def wait_ready(log: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Block until the worker logs that it is ready (or died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if log.exists() and " ready." in log.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"worker not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker's main process and its pool children (a machine dying)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (a worker's pool processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def memory_of(pid: int, key: str) -> int:
    """A memory figure of ``pid`` in bytes from ``/proc/<pid>/status`` (``VmRSS``,
    ``VmHWM``: the peak resident size)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)
