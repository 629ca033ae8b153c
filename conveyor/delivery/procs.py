"""Starting and stopping real worker/beat/flower processes (``up``, ``demo``, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from conveyor.settings import ConveyorSettings


def service_env(settings: ConveyorSettings, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a child process needs to reach the same services."""
    env = dict(os.environ)
    assert settings.redis_url and settings.database_url
    env["CONVEYOR_REDIS_URL"] = settings.redis_url
    env["CONVEYOR_DATABASE_URL"] = settings.database_url
    if settings.broker_url:
        env["CONVEYOR_BROKER_URL"] = settings.broker_url
    else:
        env.pop("CONVEYOR_BROKER_URL", None)  # the Redis URL is the broker, as in this process
    env["CONVEYOR_HOME"] = str(settings.resolved_home())
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the file as they happen (kills lose nothing)
    # The deployment is imported from its directory, whatever the child's working directory
    # (Flower runs in the home): it is not installed.
    root = str(settings.resolved_root())
    env["CONVEYOR_ROOT"] = root
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def terminate_with_parent() -> None:
    """In a child before it runs its program (``preexec_fn``): ask Linux to send it
    SIGTERM when its parent dies, even by SIGKILL, so that nothing a supervisor started
    outlives it in a session of its own. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _node_name(hostname: str | None) -> str:
    return f"conveyor-{os.getpid()}-{time.monotonic_ns()}@%h" if hostname is None else hostname


def start_worker(
    settings: ConveyorSettings,
    *,
    queues: Sequence[str],
    concurrency: int | None = None,
    hostname: str | None = None,
    log_path: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    plain_celery: bool = False,
    die_with_parent: bool = False,
    prefix: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``conveyor worker`` (prefork; SIGTERM bounded by the soft-shutdown timeout) as
    a child process, or with ``plain_celery`` ``celery -A <app> worker`` (unbounded). With
    ``die_with_parent`` it gets SIGTERM when the calling process dies, however it dies.
    ``prefix`` is a command the worker's command line runs under (``unshare …`` or
    ``nsenter …`` into another host's namespaces). ``hostname=""``: the worker names itself."""
    command = ["celery", "-A", settings.app] if plain_celery else ["conveyor"]
    args = [
        *prefix,
        sys.executable,
        "-m",
        *command,
        "worker",
        "-Q",
        ",".join(queues),
        "-c",
        str(concurrency or settings.worker_concurrency),
        "-P",
        "prefork",
        "-l",
        "INFO",
        "--without-mingle",
        "--without-gossip",
        *(["-n", name] if (name := _node_name(hostname)) else []),
        *extra_args,
    ]
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115
    try:
        return subprocess.Popen(
            args,
            env=service_env(settings, extra_env),
            stdout=out or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=terminate_with_parent if die_with_parent else None,
        )
    finally:
        if out is not None:  # the child keeps its own copy of the descriptor
            out.close()


def stop(proc: subprocess.Popen[bytes], *, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
    """Signal ``proc`` (warm shutdown by default), escalate to SIGKILL after ``timeout``."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    return int(proc.returncode if proc.returncode is not None else -1)
