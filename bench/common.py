"""What every benchmark shares: private services, the platform, progress on stderr."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis import Redis

if TYPE_CHECKING:
    from celery import Celery

    from conveyor.platform import Platform
    from conveyor.settings import ConveyorSettings

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_REDIS = "redis://127.0.0.1:6379"
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432"


class BenchError(RuntimeError):
    """The benchmark could not produce a valid measurement."""


def log(message: str) -> None:
    """Human progress, on stderr (stdout carries only the name=value lines)."""
    print(message, file=sys.stderr, flush=True)


def add_service_args(parser: argparse.ArgumentParser, *, redis_db: int, database: str) -> None:
    """``--redis``, ``--pg``, ``--redis-db`` and ``--database``, with this bench's defaults."""
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis base URL, without a DB index")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--redis-db", type=int, default=redis_db, help="Redis DB index (flushed)")
    parser.add_argument("--database", default=database, help="Postgres database (dropped and created)")


def recreate_database(pg: str, name: str, *, create: bool = True) -> None:
    """Drop (and by default create again) the bench database."""
    import psycopg

    with psycopg.connect(f"{pg.rstrip('/')}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            conn.execute(f'CREATE DATABASE "{name}"')


@dataclass
class Services:
    """A flushed Redis DB, a fresh database, a temporary home."""

    redis_url: str
    database_url: str
    home: Path
    redis: Redis
    pg: str
    database: str

    def release(self) -> None:
        """Drop the bench database and empty its Redis DB."""
        recreate_database(self.pg, self.database, create=False)
        self.redis.flushdb()
        self.redis.close()


def prepare(args: argparse.Namespace, *, prefix: str) -> Services:
    """Flush/create the bench's own services and point the settings at them.

    Settings are read when ``config.celery_app`` is imported, so this must run first.
    """
    redis_url = f"{args.redis.rstrip('/')}/{args.redis_db}"
    database_url = f"{args.pg.rstrip('/')}/{args.database}"
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["CONVEYOR_REDIS_URL"] = redis_url
    os.environ["CONVEYOR_DATABASE_URL"] = database_url
    os.environ["CONVEYOR_HOME"] = str(home)
    redis = Redis.from_url(redis_url)
    redis.flushdb()
    recreate_database(args.pg, args.database)
    return Services(redis_url, database_url, home, redis, args.pg, args.database)


def open_platform() -> Platform:
    """The deployment's platform, stages imported, schema migrated."""
    from config.celery_app import platform
    from config.migrations import upgrade

    platform.app.loader.import_default_modules()
    upgrade(platform.engine)
    return platform


# kombu's Redis transport keeps delivered-but-unacked messages here (acks_late).
UNACKED_KEYS = ("unacked", "unacked_index")
READY_TIMEOUT = 60.0
POLL_INTERVAL = 0.05


@dataclass
class RunResult:
    """One timed run of one side."""

    side: str
    n: int
    seconds: float
    submit_seconds: float

    @property
    def per_second(self) -> float:
        """Items per second, submission included."""
        return self.n / self.seconds


@dataclass
class BenchWorker:
    """A benchmark's real ``celery worker -P prefork`` subprocess, one at a time."""

    home: Path
    proc: subprocess.Popen[bytes] | None = None
    name: str = "worker"

    @property
    def logs(self) -> Path:
        """Where the workers' logs go (kept when a benchmark fails)."""
        return self.home / "logs"

    def start(
        self,
        settings: ConveyorSettings,
        app: Celery,
        *,
        name: str,
        queues: Sequence[str],
        concurrency: int,
        extra_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> str:
        """Start the worker for ``settings.app`` and wait until it answers a ping.

        Returns its hostname. ``name`` labels its hostname and its log file.
        """
        from conveyor.delivery.procs import start_worker

        if self.proc is not None:
            raise BenchError("a worker is already running")
        self.name = name
        hostname = f"bench-{name}-{os.getpid()}@{socket.gethostname()}"
        self.logs.mkdir(exist_ok=True)
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = start_worker(
            settings,
            queues=queues,
            concurrency=concurrency,
            hostname=hostname,
            log_path=self.logs / f"{name}.log",
            extra_env={**(extra_env or {}), "PYTHONPATH": pythonpath},
            extra_args=extra_args,
            # A raw Celery app has no Conveyor platform: it runs under plain `celery worker`.
            plain_celery=getattr(app, "conveyor", None) is None,
        )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            self.check()
            if app.control.ping(destination=[hostname], timeout=0.5):
                return hostname
        raise BenchError(f"{name} worker did not answer a ping within {READY_TIMEOUT}s; see {self.logs}")

    def check(self) -> None:
        """Fail fast when the worker died under the run."""
        if self.proc is not None and self.proc.poll() is not None:
            raise BenchError(f"{self.name} worker exited with {self.proc.returncode}; see {self.logs}")

    def stop(self) -> None:
        """Warm-stop the worker, if one runs."""
        from conveyor.delivery.procs import stop

        if self.proc is None:
            return
        try:
            code = stop(self.proc)
        finally:
            self.proc = None
        if code != 0:
            log(f"  {self.name} worker exited with {code}")


def backlog(redis: Redis, queues: Sequence[str]) -> int:
    """Messages waiting in ``queues`` plus delivered-but-unacked ones."""
    pipe = redis.pipeline()
    for queue in queues:
        pipe.llen(queue)
    pipe.hlen(UNACKED_KEYS[0])
    pipe.zcard(UNACKED_KEYS[1])
    return int(sum(pipe.execute()))


def wait_drained(redis: Redis, queues: Sequence[str], timeout: float = 30.0) -> None:
    """Wait until ``queues`` and the unacked set are empty (the last ack reached Redis)."""
    deadline = time.monotonic() + timeout
    while left := backlog(redis, queues):
        if time.monotonic() > deadline:
            raise BenchError(f"queues {', '.join(queues)} not drained: {left} messages left")
        time.sleep(POLL_INTERVAL)


def check_all_succeeded(platform: Platform, expected: int) -> None:
    """Every job this benchmark submitted ended ``succeeded``; nothing in the DLQ."""
    from sqlalchemy import func, select

    from conveyor.store.db.schema import dead_letters

    with platform.engine.connect() as conn:
        counts = platform.store.count_by_status(conn)
        dead = int(conn.execute(select(func.count()).select_from(dead_letters)).scalar_one())
    if counts != {"succeeded": expected} or dead:
        raise BenchError(f"expected {expected} succeeded jobs, found {counts} and {dead} dead letters")


# -- CPU per process group, from /proc ------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (state) on, or None when the process is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """``(utime + stime, starttime)`` of ``pid`` in clock ticks, or None when it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # stat fields 14, 15 (utime, stime) and 22 (starttime); fields[0] is field 3.
    return int(fields[11]) + int(fields[12]), int(fields[19])


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def uptime_ticks() -> float:
    """Seconds since boot, in clock ticks (the unit of ``starttime``)."""
    return float(Path("/proc/uptime").read_text().split()[0]) * CLK_TCK


class CpuMeter:
    """CPU seconds (user + system) used by groups of processes over a window.

    Each group is a function returning its pids now; they are sampled at the start, every
    ``interval`` seconds on a thread, and at the end, so a process that exits during the
    window still counts up to its last sample, and one born during it counts from zero.
    """

    def __init__(self, groups: Mapping[str, Callable[[], Iterable[int]]], interval: float = 0.2) -> None:
        self.groups = dict(groups)
        self.interval = interval
        self.first: dict[tuple[str, int], int] = {}
        self.last: dict[tuple[str, int], int] = {}
        self.started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Read every group's processes once."""
        for group, pids in self.groups.items():
            for pid in pids():
                ticks = cpu_ticks(pid)
                if ticks is None:
                    continue
                used, born = ticks
                key = (group, pid)
                if key not in self.first:
                    self.first[key] = 0 if born > self.started else used
                self.last[key] = used

    def start(self) -> None:
        """Open the window: first sample now, then every ``interval`` on a thread."""
        self.started = uptime_ticks()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> dict[str, float]:
        """Close the window; CPU seconds per group."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        used = dict.fromkeys(self.groups, 0.0)
        for (group, pid), last in self.last.items():
            used[group] += (last - self.first[(group, pid)]) / CLK_TCK
        return used


def raw_queue_config(settings: ConveyorSettings, queue: str, exchange: str) -> dict[str, Any]:
    """The Celery config the deployment's app gets, for a bench's plain Celery app (its raw
    side) on a queue of its own (``queue``, on a direct exchange ``exchange``)."""
    from kombu.entity import Exchange, Queue

    from conveyor.delivery.celeryconfig import celery_config

    routed = Queue(queue, Exchange(exchange, type="direct"), routing_key=queue)  # type: ignore[no-untyped-call]
    return celery_config(settings, queues=[routed], default_queue=queue)
