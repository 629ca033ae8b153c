"""The ``run.json`` file that lets conveyor commands find a running ``conveyor up``.

``conveyor up`` claims ``<home>/run.json`` under an exclusive lock and writes
its endpoints there; other commands read it to attach to that run.  A file
left behind by a run that was killed is recognised as stale (its pid is gone)
and is replaced by the next claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_FILE",
    "RUN_FILE",
    "RunInfo",
    "RunningError",
    "claim_run",
    "lease_owner",
    "local_node",
    "local_pid",
    "owner_id",
    "pid_alive",
    "read_run_info",
    "release_run",
    "run_lock",
    "write_run_info",
]

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class RunInfo:
    """What a running ``conveyor up`` publishes about itself."""

    pid: int
    redis_url: str
    database_url: str
    started_at: float
    redis_pid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise to a JSON document (``extra`` must be JSON-serialisable)."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunInfo:
        """Parse a document written by :meth:`to_json`.

        Raises ``ValueError`` if the text is not JSON or lacks a required field
        or has one of the wrong type.  Unknown keys are ignored so that a newer
        conveyor's file can still be read by an older one.
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("run file is not a JSON object")
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError("run file field 'extra' is not an object")
        redis_pid = data.get("redis_pid")
        return cls(
            pid=_require_int(data, "pid"),
            redis_url=_require_str(data, "redis_url"),
            database_url=_require_str(data, "database_url"),
            started_at=_require_float(data, "started_at"),
            redis_pid=None if redis_pid is None else _require_int(data, "redis_pid"),
            extra=extra,
        )


class RunningError(RuntimeError):
    """Raised by :func:`claim_run` when another live run owns ``run.json``."""

    def __init__(self, existing: RunInfo) -> None:
        super().__init__(f"conveyor is already running (pid {existing.pid})")
        self.existing = existing


def _require_int(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    # bool is a subclass of int, but ``true`` is never a valid pid.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"run file field {key!r} is not an integer")
    return value


def _require_float(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"run file field {key!r} is not a number")
    return float(value)


def _require_str(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"run file field {key!r} is not a string")
    return value


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        # No /proc (not Linux) or the process just went away: the caller's
        # os.kill check is the best answer we have.
        return False
    # The command name in field 2 may itself contain spaces or ')', so the
    # state is taken from after the *last* ')'.
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] in ("Z", "X")


def local_node() -> str:
    """This process's node: ``host/boot/pidns``, the processes whose pids it can judge.

    ``boot`` is the kernel's boot id (random per boot, shared by every container on that
    kernel) and ``pidns`` the inode of this process's PID namespace. Neither alone is
    enough: the root namespace has the same inode on every Linux machine, and two hosts
    may share a name (pods with host networking); containers on one kernel share its boot
    id but not their namespaces. Where either cannot be read, or ``/proc`` is not this
    namespace's, the node is one of its own that no pid is judged by: a lease held there
    is taken over only once it is stale.
    """
    return _node(os.getpid())


# A node nobody else names (drawn once per import; a worker's pool children share it).
_PRIVATE = f"x{uuid.uuid4().hex[:16]}"


@functools.lru_cache(maxsize=4)
def _node(_pid: int) -> str:
    # Read once per process (every claim asks): a process keeps its host, boot and namespace.
    host = socket.gethostname()[:64].replace(":", "_") or "unknown"
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            raise OSError("/proc belongs to another PID namespace")
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        boot = Path(BOOT_ID).read_text(encoding="ascii").strip().replace("-", "")
    except OSError:
        return f"{host}/{_PRIVATE}"
    inode = namespace.strip("pid:[]")
    if len(boot) != 32 or not inode.isdigit():
        return f"{host}/{_PRIVATE}"
    return f"{host}/{boot[:16]}/{inode}"


def owner_id(pid: int | None = None, thread: int | None = None) -> str:
    """A lease owner: ``node:pid``, plus ``:thread`` for jobs run by a thread pool (see
    :func:`local_node` for the node)."""
    owner = f"{local_node()}:{os.getpid() if pid is None else pid}"
    return f"{owner}:{thread}" if thread is not None else owner


def local_pid(owner: str) -> int | None:
    """The pid of ``owner`` (a lease owner) when it names a process of this very node, whose
    pid this process can judge; None for any other: another host, boot or PID namespace, a
    private node, an owner written in an older format, or text that is not an owner."""
    node, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if node != local_node() or node.endswith(f"/{_PRIVATE}") or not pid_text.isdigit():
        return None
    return int(pid_text)


def lease_owner() -> str:
    """The calling thread's lease owner: ``node:pid``, plus the thread for a job run by a
    thread pool (any thread but the main one); see :func:`owner_id`."""
    main = threading.current_thread() is threading.main_thread()
    return owner_id(thread=None if main else threading.get_ident())


def pid_alive(pid: int) -> bool:
    """Return whether a process with this pid exists and is not a zombie.

    A process owned by another user (``EPERM``) counts as alive.
    """
    if pid <= 0:
        # 0 and negative pids address process groups, not one process.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not _is_zombie(pid)


def _load(path: Path) -> RunInfo | None:
    try:
        return RunInfo.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_run_info(home: Path) -> RunInfo | None:
    """Return the live run recorded in ``home/run.json``, if there is one.

    Returns ``None`` when the file is missing, cannot be parsed, or belongs to
    a process that is no longer alive.  No lock is needed: writers replace the
    file atomically.
    """
    info = _load(home / RUN_FILE)
    if info is None or not pid_alive(info.pid):
        return None
    return info


def stale_run(home: Path) -> RunInfo | None:
    """The run ``home/run.json`` records if its ``conveyor up`` died without cleaning up
    (killed): what it started and may have left, such as its embedded Redis."""
    info = _load(home / RUN_FILE)
    if info is None or pid_alive(info.pid):
        return None
    return info


@contextlib.contextmanager
def run_lock(home: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``home/run.lock``, creating ``home``.

    Blocks until the lock is free.  The lock is not re-entrant: do not nest
    it, or call :func:`claim_run`/:func:`release_run` while holding it.
    """
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write_run_info(home: Path, info: RunInfo) -> None:
    """Atomically write ``info`` to ``home/run.json``.

    Call only while holding :func:`run_lock`.  Readers see either the old or
    the new file, never a partial one.
    """
    home.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".run.", suffix=".json.tmp", dir=home)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(info.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, home / RUN_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def claim_run(home: Path, info: RunInfo) -> RunInfo:
    """Record ``info`` as the current run, unless another live run exists.

    Raises :class:`RunningError` carrying the existing run if one is alive; a
    missing, corrupt or stale file is replaced.
    """
    with run_lock(home):
        existing = read_run_info(home)
        if existing is not None:
            raise RunningError(existing)
        write_run_info(home, info)
        return info


def release_run(home: Path, pid: int) -> None:
    """Remove ``home/run.json`` if, and only if, it was written by ``pid``.

    The owner's liveness is not checked, so a supervisor may also release a
    run whose process it has already stopped.
    """
    with run_lock(home):
        path = home / RUN_FILE
        info = _load(path)
        if info is not None and info.pid == pid:
            path.unlink(missing_ok=True)
