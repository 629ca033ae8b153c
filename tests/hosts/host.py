"""A "host" for tests: a real ``conveyor worker`` in UTS and PID namespaces of its own.

Each host has the hostname it is given (two may share one, as pods with host networking
do), its own pids (its worker's main process is pid 1 there) and, optionally, a clock
that runs off by a fixed offset (``libfaketime`` preloaded from its PyPI wheel). Hosts
stay in this machine's network namespace and reach the services on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import service_env, start_worker
from tests.fault.conftest import wait_ready

UNSHARE = shutil.which("unshare")
needs_unshare = pytest.mark.skipif(
    UNSHARE is None, reason="a host is a process group in its own namespaces: needs unshare (util-linux)"
)

# Runs the worker's command line as the namespaces' first process, after naming the host.
_NAMED = 'hostname "$0" && exec "$@"'


# Timers of the host tests: a lease of 4 s, limits far from every window they watch.
LEASE = 4.0
TIMERS = {
    "CONVEYOR_LEASE_TIMEOUT": str(LEASE),
    "CONVEYOR_WORKER_ALIVE_TTL": "2",
    "CONVEYOR_VISIBILITY_TIMEOUT": "400",
    "CONVEYOR_DEFAULT_TIME_LIMIT": "300",
    "CONVEYOR_DEFAULT_SOFT_TIME_LIMIT": "290",
}


def faketime_library() -> str:
    """The ``libfaketime`` shared object the ``libfaketime`` wheel ships (a test extra)."""
    spec = importlib.util.find_spec("libfaketime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the libfaketime package is missing: pip install -e '.[test]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "vendor/libfaketime/src/libfaketime.so.1"
    if not path.exists():
        raise RuntimeError(f"the libfaketime wheel has no {path}")
    return str(path)


def skewed(offset: float) -> dict[str, str]:
    """Environment that runs a process's wall clock ``offset`` seconds off (and its forks').

    The monotonic clock stays real: Debian's libfaketime 0.9.10 faked it too and hung
    Python's timed waits; with the monotonic clock left alone, only ``time.time()``,
    ``datetime.now()`` and the like are off."""
    return {
        "LD_PRELOAD": faketime_library(),
        "FAKETIME": f"{offset:+g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "DONT_FAKE_MONOTONIC": "1",  # the spelling of older libfaketime releases
        "FAKETIME_NO_CACHE": "1",
    }


def namespaces(hostname: str) -> list[str]:
    """The command prefix that runs a command line as a host named ``hostname``."""
    assert UNSHARE is not None
    return [UNSHARE, "--uts", "--pid", "--mount-proc", "--kill-child", "sh", "-c", _NAMED, hostname]


def clock_offset(env: Mapping[str, str], redis_time: float) -> float:
    """How far a process started with ``env`` reads the wall clock from ``redis_time``."""
    out = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return float(out.stdout) - redis_time


@dataclass
class Host:
    """One host: ``unshare`` (``proc``), the worker it runs as pid 1, and its log."""

    hostname: str
    proc: subprocess.Popen[bytes]
    log: Path

    def worker_pid(self) -> int:
        """The worker's main process, as this machine numbers it (``unshare``'s child)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def pid_namespace(self) -> str:
        """The inode of the host's PID namespace, as lease owners name it."""
        return os.readlink(f"/proc/{self.worker_pid()}/ns/pid").strip("pid:[]")

    def owns(self, lease_owner: str | None) -> bool:
        """Whether ``lease_owner`` is a process of this host."""
        node = (lease_owner or "").partition(":")[0]
        return node.startswith(f"{self.hostname}/") and node.endswith(f"/{self.pid_namespace()}")

    def wait_ready(self) -> None:
        """Block until its worker is ready to take jobs."""
        wait_ready(self.log, self.proc)

    def alive(self) -> bool:
        """Whether the host still runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of the host at once (the machine died)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """A warm shutdown of its worker, then whatever is left is killed."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError, AssertionError, OSError):
                os.kill(self.worker_pid(), signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        self.kill()


class Hosts:
    """Starts hosts for one test; :meth:`close` kills what is left."""

    def __init__(self, platform: Any, directory: Path) -> None:
        self.platform = platform
        self.directory = directory
        self.started: list[Host] = []

    def start(
        self,
        hostname: str,
        *,
        concurrency: int = 2,
        env: Mapping[str, str] | None = None,
        nodename: str = "worker@%h",
        wait: bool = True,
    ) -> Host:
        """Start a worker host named ``hostname`` and (unless not ``wait``) wait until it is
        ready. Celery's node name defaults to the same on every host of one name, as in a
        real deployment."""
        log = self.directory / f"host-{len(self.started)}-{hostname}.log"
        proc = start_worker(
            self.platform.settings,
            queues=[q.name for q in self.platform.queues],
            concurrency=concurrency,
            hostname=nodename,
            log_path=log,
            extra_env=dict(env or {}),
            prefix=namespaces(hostname),
        )
        host = Host(hostname, proc, log)
        self.started.append(host)
        if wait:
            host.wait_ready()
        return host

    def close(self) -> None:
        """Stop every host still running."""
        for host in self.started:
            host.kill()


def run_in(hostname: str, env: Mapping[str, str], code: str, settings: Any) -> str:
    """Run Python ``code`` as a process of a host named ``hostname`` (fresh namespaces,
    the same clock offset as its ``env`` gives); its standard output."""
    out = subprocess.run(
        [*namespaces(hostname), sys.executable, "-c", code],
        env=service_env(settings, env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
