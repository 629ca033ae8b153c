"""Throughput of Conveyor's tracked lifecycle against Celery and Procrastinate, in one run.

Two figures, both with a real worker subprocess and 4 pool slots on every side.

**Drain** (issue #16): per side, enqueue N no-op jobs with no worker running (timed:
``enqueue_per_s``), then start the worker on an idle queue, wait until it answers a ping,
and only then point it at the full queue (``add_consumer``), so its boot is not measured;
the drain is timed from the moment it takes the first message (the consumer adds the queue
when its BRPOP on the idle queue returns) until the last job is done (``drain_per_s``). The
worker is cold: its pool children's first-job setup is in the window, spread over N. After the
enqueue, each Postgres side's database is ``ANALYZE``d, as autovacuum would have done in a
steady state (without it the planner believes the queue is empty, and Procrastinate's fetch
cost more than trebled). Over the drain window:

* CPU per job by process group, from ``/proc/<pid>/stat`` (utime + stime), sampled every
  0.2 s so processes that come or go in the window count: the worker's process tree, the
  redis-server process (``INFO server`` gives its pid) and the Postgres backends connected
  to the side's own database (``pg_stat_activity``); WAL writer, checkpointer and the
  backends of other databases are not counted.
* ``redis_cmds_per_job``: the ``total_commands_processed`` delta, less the bench's own
  polling and less the server's background rate measured just before (the server is shared;
  point ``--redis`` at a private redis-server for exact figures).
* ``commits_per_job``: the ``pg_stat_database.xact_commit`` delta of the side's database,
  read once the worker stopped (a backend flushes its statistics when it exits). Read-only
  transactions that end in COMMIT count too, as Postgres counts them.

Sides, each on its own Redis DB and, where it needs one, its own Postgres database:

* ``tracked``: Conveyor, ``platform.submit("conveyor.demo.noop", {"n": i})``, worker
  ``conveyor worker`` with ``conveyor.delivery.celeryconfig.celery_config()`` as it is now.
* ``same_config``: a plain Celery task under ``celery worker`` with the frozen copy of that
  config (:mod:`bench.frozen_config`: late acks, prefetch disabled, task and sent events,
  Redis result backend); results are checked after the drain.
* ``default``: a plain Celery task, Celery's defaults but the broker URL (no result backend,
  early acks, prefetch multiplier 4, no events).
* ``procrastinate``: Procrastinate 3 when installed (``pip install -e '.[bench]'``), job
  state in Postgres, no Redis; 2 ``procrastinate worker`` processes with concurrency 2,
  LISTEN/NOTIFY on, jobs kept. Its workers take jobs as soon as they start, so its drain
  window opens when both have registered (``procrastinate_workers``) and counts the jobs
  left then.

Runs are interleaved (default, same_config, tracked, procrastinate, default, ...) and the
median per side is reported, with the ratios ``drain_ratio_vs_default``,
``drain_ratio_vs_same_config``, ``drain_ratio_vs_procrastinate`` and
``cpu_ratio_vs_same_config`` (tracked over the other side).

**Concurrent submit + drain** (the older figure): the worker runs while four threads submit;
tracked against ``same_config``, timed from the first submit until every job is terminal
(tracked: a ``COUNT`` of the DB every 50 ms) or every result is in the backend (raw).
Printed as ``tracked_jobs_per_s``, ``raw_celery_tasks_per_s`` and ``ratio``.

Usage::

    .venv/bin/python -m bench.throughput                 # --full: N=5000, 3 runs per side
    .venv/bin/python -m bench.throughput --smoke         # CI: small N, 1 run
    .venv/bin/python -m bench.throughput --mode drain --n 2000 --runs 5

Progress goes to stderr; stdout carries only ``name=value`` lines.

Importing this module is cheap and reads no settings, except in a worker process started
by the bench (``celery -A bench.throughput:raw_app``), where ``CONVEYOR_REDIS_URL`` is set
and the plain apps configure themselves from the environment, or a Procrastinate worker
(``BENCH_PROCRASTINATE_DSN``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import celery
from celery import Celery
from celery.result import AsyncResult

from bench.common import (
    POLL_INTERVAL,
    ROOT,
    UNACKED_KEYS,
    BenchError,
    BenchWorker,
    CpuMeter,
    RunResult,
    add_service_args,
    backlog,
    check_all_succeeded,
    log,
    open_platform,
    prepare,
    process_tree,
    recreate_database,
    wait_drained,
)
from bench.frozen_config import frozen_celery_config
from config.queues import DEFAULT_QUEUE, QUEUES

if TYPE_CHECKING:
    import psycopg
    from redis import Redis

    from conveyor.platform import Platform
    from conveyor.settings import ConveyorSettings

QUEUE = "demo"
# A declared queue that stays empty: drain workers start on it, then add QUEUE.
IDLE_QUEUE = DEFAULT_QUEUE
TRACKED_STAGE = "conveyor.demo.noop"
RAW_TASK = "bench.raw.noop"
RAW_APP = "bench.throughput:raw_app"
DEFAULT_TASK = "bench.default.noop"
DEFAULT_APP = "bench.throughput:default_app"
PROCRASTINATE_TASK = "bench.procrastinate.noop"
PROCRASTINATE_APP = "bench.throughput.procrastinate_app"
PROCRASTINATE_DSN_ENV = "BENCH_PROCRASTINATE_DSN"
PROCRASTINATE_PROCESSES = 2
PROCRASTINATE_CONCURRENCY = 2
REDIS_DB = 12  # tracked; same_config uses REDIS_DB + 1, default REDIS_DB + 2
DATABASE = "conveyor_bench"
PROCRASTINATE_DATABASE = "conveyor_bench_procrastinate"
FULL_N = 5000
SMOKE_N = 40
CONCURRENCY = 4
IDLE_PAUSE = 0.5
BACKGROUND_WINDOW = 1.0
DRAIN_POLL = 0.02
PIPELINE_POLL_CMDS = 3  # LLEN + HLEN + ZCARD, no MULTI/EXEC

SIDES = ("default", "same_config", "tracked", "procrastinate")
ENQUEUE_THREADS = (1, 4)  # one request thread, and a web app's four


# -- the plain Celery sides: nothing from Conveyor's runtime -------------------------------

# Celery with the frozen "same-config" baseline (bench/frozen_config.py).
raw_app = Celery("conveyor_bench_raw")
# Celery as it comes: the broker URL and nothing else (no result backend).
default_app = Celery("conveyor_bench_default")


def configure_raw_app(settings: ConveyorSettings) -> None:
    """Give :data:`raw_app` the frozen copy of Conveyor's Celery config, on ``settings``'s Redis."""
    raw_app.conf.update(frozen_celery_config(settings, queues=QUEUES, default_queue=DEFAULT_QUEUE))


def configure_default_app(redis_url: str) -> None:
    """Give :data:`default_app` Celery's defaults but the broker URL."""
    default_app.conf.update(broker_url=redis_url)


@raw_app.task(name=RAW_TASK)  # type: ignore[untyped-decorator]
def noop(n: int) -> dict[str, int]:
    """The raw counterpart of ``conveyor.demo.noop``."""
    return {"n": n}


@default_app.task(name=DEFAULT_TASK)  # type: ignore[untyped-decorator]
def default_noop(n: int) -> dict[str, int]:
    """The default-Celery counterpart of ``conveyor.demo.noop`` (its result goes nowhere)."""
    return {"n": n}


if os.environ.get("CONVEYOR_REDIS_URL"):
    # A worker process: same environment as the tracked worker (conveyor.delivery.procs.service_env).
    # A fresh Settings(), not the cached get_settings(): in the bench process this runs at
    # import, before main() sets the environment (main() configures the apps again).
    from config.settings import Settings

    _worker_settings = Settings()
    configure_raw_app(_worker_settings)
    configure_default_app(os.environ["CONVEYOR_REDIS_URL"])


# -- the Procrastinate side, when its package is installed (the `bench` extra) -------------

try:
    import procrastinate
except ImportError:  # pragma: no cover - depends on the extra
    procrastinate = None

procrastinate_app: Any = None
procrastinate_noop: Any = None
# Not in ``__main__``: ``python -m bench.throughput`` hands over to ``bench.throughput``,
# whose app is the one the workers import.
if procrastinate is not None and __name__ != "__main__":
    procrastinate_app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=os.environ.get(PROCRASTINATE_DSN_ENV, ""))
    )

    @procrastinate_app.task(name=PROCRASTINATE_TASK, queue=QUEUE)  # type: ignore[misc]
    def _procrastinate_noop(n: int) -> dict[str, int]:
        """The Procrastinate counterpart of ``conveyor.demo.noop``."""
        return {"n": n}

    procrastinate_noop = _procrastinate_noop


def side_configs() -> dict[str, str]:
    """What each side ran, as printed (``<side>_config=...``)."""
    configs = {
        "default": f"celery {celery.__version__} defaults, broker_url only (no result backend, "
        "early acks, prefetch x4, no events)",
        "same_config": f"celery {celery.__version__} with bench/frozen_config.py (conveyor's "
        "celery_config() frozen at 7d2e024: late acks, prefetch off, task+sent events, "
        "redis result backend)",
        "tracked": "conveyor worker, conveyor.delivery.celeryconfig.celery_config() as of this checkout, "
        "platform.submit conveyor.demo.noop",
    }
    if procrastinate is not None:
        from importlib.metadata import version

        configs["procrastinate"] = (
            f"procrastinate {version('procrastinate')}, {PROCRASTINATE_PROCESSES} worker processes "
            f"x concurrency {PROCRASTINATE_CONCURRENCY}, listen/notify, jobs kept"
        )
    return configs


# -- measuring helpers ----------------------------------------------------------------------


class Monitor:
    """One autocommit connection to the ``postgres`` database (so its own statements count
    in no bench database): backends, commits, and the Redis server's counters."""

    def __init__(self, pg: str, redis: Redis) -> None:
        import psycopg

        self.conn: psycopg.Connection[Any] = psycopg.connect(f"{pg.rstrip('/')}/postgres", autocommit=True)
        self.redis = redis
        self.redis_pid = int(redis.info("server")["process_id"])
        if not Path(f"/proc/{self.redis_pid}/stat").exists():
            log(f"redis-server pid {self.redis_pid} is not visible here: its CPU counts as 0")

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    def backends(self, database: str) -> list[int]:
        """Pids of the Postgres backends connected to ``database``."""
        rows = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,))
        return [int(r[0]) for r in rows]

    def commits(self, database: str) -> int:
        """``pg_stat_database.xact_commit`` of ``database``."""
        row = self.conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
        return int(row[0]) if row else 0

    def settled_commits(self, database: str, timeout: float = 10.0) -> int:
        """Commits once no backend is connected to ``database`` (exits flush statistics)."""
        deadline = time.monotonic() + timeout
        while self.backends(database):
            if time.monotonic() > deadline:
                log(f"  backends still connected to {database}: commits may lag")
                break
            time.sleep(0.05)
        time.sleep(0.2)
        return self.commits(database)

    def redis_commands(self) -> int:
        """``total_commands_processed`` (server-wide); the INFO itself is one more."""
        return int(self.redis.info("stats")["total_commands_processed"])

    def background(self, seconds: float = BACKGROUND_WINDOW) -> tuple[float, float]:
        """The Redis server's rate of commands and of CPU seconds while the bench is idle."""
        meter = CpuMeter({"redis": lambda: [self.redis_pid]})
        before = self.redis_commands()
        meter.start()
        start = time.perf_counter()
        time.sleep(seconds)
        cpu = meter.stop()["redis"]
        elapsed = time.perf_counter() - start
        cmds = self.redis_commands() - before - 1
        return max(0.0, cmds / elapsed), max(0.0, cpu / elapsed)


@dataclass
class DrainResult:
    """One drain run of one side."""

    side: str
    n: int
    enqueue_seconds: float
    drain_seconds: float
    drain_jobs: int  # jobs done inside the drain window
    cpu: dict[str, float]  # CPU seconds per group over the drain window
    redis_cmds: float  # over the drain, background and the bench's polling taken out
    commits: int  # over the drain (every job)
    enqueue_commits: int

    @property
    def enqueue_per_s(self) -> float:
        return self.n / self.enqueue_seconds

    @property
    def drain_per_s(self) -> float:
        return self.drain_jobs / self.drain_seconds

    def cpu_us(self, group: str | None = None) -> float:
        """CPU µs per job of one group, or of all of them."""
        used = sum(self.cpu.values()) if group is None else self.cpu[group]
        return used / self.drain_jobs * 1e6

    @property
    def redis_cmds_per_job(self) -> float:
        return self.redis_cmds / self.n

    @property
    def commits_per_job(self) -> float:
        return self.commits / self.n


@dataclass
class CeleryDrainSide:
    """What differs between the three Celery-based sides of the drain."""

    name: str
    app: Celery
    settings: ConveyorSettings  # the worker's settings: its app module and its Redis DB
    redis: Redis
    database: str | None
    enqueue: Callable[[int], Any]
    finished: Callable[[Any], bool]  # once the queue is empty: is the last job done?
    verify: Callable[[Any], None]


# -- the benchmark ---------------------------------------------------------------------------


@dataclass
class Bench:
    """Everything one benchmark invocation needs: services, platform, options."""

    platform: Platform
    redis: Redis  # tracked side's DB
    raw_redis: Redis  # same_config's DB
    default_redis: Redis  # default's DB
    pg: str
    database: str
    n: int
    concurrency: int
    home: Path
    submitters: int = 4
    enqueue_threads: int = 1
    results: list[RunResult] = field(default_factory=list)
    drains: list[DrainResult] = field(default_factory=list)
    worker: BenchWorker = field(init=False)
    monitor: Monitor = field(init=False)
    bench_cmds: int = 0  # Redis commands the bench's own polling sent in the current window

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)
        self.monitor = Monitor(self.pg, self.redis)

    # -- workers ---------------------------------------------------------------------

    def raw_settings(self, app: str, redis: Redis) -> ConveyorSettings:
        """The platform's settings, pointed at a plain app and its own Redis DB."""
        settings = self.platform.settings
        url = redis_url_of(redis)
        assert settings.database_url
        return settings.with_urls(url, settings.database_url).model_copy(update={"app": app})

    def start_worker(self, side: str, run: int) -> str:
        """Start the concurrent mode's worker of ``side`` (only one at a time)."""
        settings, app = self.platform.settings, self.platform.app
        if side == "raw":
            settings, app = self.raw_settings(RAW_APP, self.raw_redis), raw_app
        return self.worker.start(
            settings, app, name=f"{side}-{run}", queues=[QUEUE], concurrency=self.concurrency
        )

    def stop_worker(self, redis: Redis | None = None) -> None:
        """Warm-stop the running worker, after its last ack reached Redis."""
        if self.worker.proc is None:
            return
        try:
            wait_drained(redis or self.redis, [QUEUE])
        finally:
            self.worker.stop()

    # -- queue hygiene ---------------------------------------------------------------

    def backlog(self, redis: Redis | None = None) -> int:
        """Messages waiting in the queue plus delivered-but-unacked ones."""
        return backlog(redis or self.redis, [QUEUE])

    def counted_backlog(self, redis: Redis) -> int:
        """:meth:`backlog`, counting the commands it sends (taken out of the side's figure)."""
        pipe = redis.pipeline(transaction=False)
        pipe.llen(QUEUE)
        pipe.hlen(UNACKED_KEYS[0])
        pipe.zcard(UNACKED_KEYS[1])
        self.bench_cmds += PIPELINE_POLL_CMDS
        return int(sum(pipe.execute()))

    # -- tracked side ----------------------------------------------------------------

    def non_terminal(self) -> int:
        """Jobs not yet terminal (a COUNT by status; the status index answers it)."""
        from sqlalchemy import func, select

        from conveyor.store.db.schema import TERMINAL, jobs

        q = select(func.count()).select_from(jobs).where(jobs.c.status.not_in(sorted(TERMINAL)))
        with self.platform.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def wait_terminal(self, timeout: float) -> None:
        """Poll every 50 ms until every job in the database is terminal."""
        deadline = time.monotonic() + timeout
        while self.non_terminal():
            if time.monotonic() > deadline:
                raise BenchError(f"{self.non_terminal()} tracked jobs not terminal after {timeout:.0f}s")
            self.worker.check()
            time.sleep(POLL_INTERVAL)

    def submit_tracked(self, count: int, threads: int | None = None) -> None:
        """Submit ``count`` no-op jobs through the platform."""
        submit = self.platform.submit
        threads = self.submitters if threads is None else threads
        fan_out(threads, count, lambda i: submit(TRACKED_STAGE, {"n": i}))

    def run_tracked(self, run: int) -> RunResult:
        """One timed concurrent tracked run with a fresh worker."""
        self.start_worker("tracked", run)
        try:
            warm = 2 * self.concurrency
            self.submit_tracked(warm)
            self.wait_terminal(timeout=60)
            wait_drained(self.redis, [QUEUE])
            time.sleep(IDLE_PAUSE)
            expected = self.platform_total() + self.n
            start = time.perf_counter()
            self.submit_tracked(self.n)
            submitted = time.perf_counter()
            self.wait_terminal(timeout=max(120.0, self.n * 0.2))
            end = time.perf_counter()
            check_all_succeeded(self.platform, expected)
        finally:
            self.stop_worker(self.redis)
        return RunResult("tracked", self.n, end - start, submitted - start)

    def forget_jobs(self) -> None:
        """Empty the tracked side's job and event tables (its own database)."""
        from conveyor.store.db.schema import job_events, jobs

        with self.platform.engine.begin() as conn:
            conn.execute(job_events.delete())
            conn.execute(jobs.delete())

    def platform_total(self) -> int:
        """How many jobs the database holds."""
        from sqlalchemy import func, select

        from conveyor.store.db.schema import jobs

        with self.platform.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())

    # -- raw side (concurrent mode) ----------------------------------------------------

    def submit_raw(self, count: int) -> list[AsyncResult]:
        """Publish ``count`` raw no-op tasks, from ``submitters`` threads."""
        send = noop.apply_async
        return fan_out(self.submitters, count, lambda i: send(kwargs={"n": i}, queue=QUEUE))

    def collect_raw(self, results: Sequence[AsyncResult], timeout: float) -> None:
        """Wait for every result (MGET polling every 50 ms) and check each value."""
        # MGET polling of the result keys: submissions came from several threads, so the
        # per-thread pub/sub result consumer cannot be relied on here.
        ids = [r.id for r in results]
        metas = dict(raw_app.backend.get_many(ids, timeout=timeout, interval=POLL_INTERVAL))
        values = [metas[i]["result"] for i in ids]
        bad = [i for i, v in enumerate(values) if v != {"n": i}]
        if bad:
            raise BenchError(f"{len(bad)} raw results were wrong (first: #{bad[0]} = {values[bad[0]]!r})")

    def run_raw(self, run: int) -> RunResult:
        """One timed concurrent raw-Celery run with a fresh worker."""
        self.start_worker("raw", run)
        try:
            self.collect_raw(self.submit_raw(2 * self.concurrency), timeout=60)
            wait_drained(self.raw_redis, [QUEUE])
            time.sleep(IDLE_PAUSE)
            start = time.perf_counter()
            results = self.submit_raw(self.n)
            submitted = time.perf_counter()
            self.collect_raw(results, timeout=max(120.0, self.n * 0.2))
            end = time.perf_counter()
        finally:
            self.stop_worker(self.raw_redis)
        return RunResult("raw", self.n, end - start, submitted - start)

    def run_concurrent(self, runs: int) -> tuple[float, float]:
        """Interleave ``runs`` concurrent runs per side; the median rates (tracked, raw)."""
        sides: list[tuple[str, Callable[[int], RunResult], Redis]] = [
            ("tracked", self.run_tracked, self.redis),
            ("raw", self.run_raw, self.raw_redis),
        ]
        for run in range(runs):
            for side, fn, redis in sides:
                if self.backlog(redis):
                    raise BenchError(f"queue {QUEUE!r} not empty before the {side} run")
                result = fn(run)
                self.results.append(result)
                log(
                    f"concurrent run {run + 1}/{runs} {side:7s}: {result.per_second:8.1f}/s "
                    f"({result.seconds:.2f}s total, {result.submit_seconds:.2f}s submitting)"
                )
        tracked = statistics.median(r.per_second for r in self.results if r.side == "tracked")
        raw = statistics.median(r.per_second for r in self.results if r.side == "raw")
        return tracked, raw

    # -- drain mode: the three Celery-based sides ---------------------------------------

    def celery_side(self, name: str) -> CeleryDrainSide:
        """The drain settings of ``tracked``, ``same_config`` or ``default``."""
        if name == "tracked":
            submit = self.platform.submit
            expected = self.platform_total() + self.n

            def tracked_finished(_: Any) -> bool:
                return self.non_terminal() == 0

            return CeleryDrainSide(
                name,
                self.platform.app,
                self.platform.settings,
                self.redis,
                self.database,
                enqueue=lambda i: submit(TRACKED_STAGE, {"n": i}),
                finished=tracked_finished,
                verify=lambda _: check_all_succeeded(self.platform, expected),
            )
        if name == "same_config":
            send = noop.apply_async
            return CeleryDrainSide(
                name,
                raw_app,
                self.raw_settings(RAW_APP, self.raw_redis),
                self.raw_redis,
                None,
                enqueue=lambda i: send(kwargs={"n": i}, queue=QUEUE),
                # Late acks: an empty queue and unacked set means every task returned.
                finished=lambda _: True,
                verify=lambda results: self.collect_raw(results, timeout=60),
            )
        send_default = default_noop.apply_async
        return CeleryDrainSide(
            name,
            default_app,
            self.raw_settings(DEFAULT_APP, self.default_redis),
            self.default_redis,
            None,
            enqueue=lambda i: send_default(kwargs={"n": i}, queue=QUEUE),
            finished=self.default_finished,
            verify=lambda _: None,
        )

    def default_finished(self, hostname: Any) -> bool:
        """Early acks: the queue empties before the last tasks ran; ask the worker."""
        inspect = default_app.control.inspect(destination=[hostname], timeout=2.0)
        stats = (inspect.stats() or {}).get(hostname) or {}
        if int(stats.get("total", {}).get(DEFAULT_TASK, 0)) < self.n:
            return False
        active = (inspect.active() or {}).get(hostname)
        return active == []

    def drain_celery(self, name: str, run: int) -> DrainResult:
        """One drain run of a Celery-based side."""
        side = self.celery_side(name)
        side.redis.flushdb()  # this side's own DB (12-15)
        monitor = self.monitor
        db = side.database
        commits0 = self.settled_commits(db)
        start = time.perf_counter()
        handles = fan_out(self.enqueue_threads, self.n, side.enqueue)
        enqueue_seconds = time.perf_counter() - start
        if db:
            analyze(f"{self.pg.rstrip('/')}/{db}")
        commits1 = self.settled_commits(db)
        if self.backlog(side.redis) != self.n:
            raise BenchError(f"{name}: {self.backlog(side.redis)} messages queued, expected {self.n}")
        bg_cmds, bg_cpu = monitor.background()

        hostname = self.worker.start(
            side.settings,
            side.app,
            name=f"drain-{name}-{run}",
            queues=[IDLE_QUEUE],
            concurrency=self.concurrency,
        )
        assert self.worker.proc is not None
        root = self.worker.proc.pid
        groups: dict[str, Callable[[], list[int]]] = {
            "worker": lambda: process_tree(root),
            "redis": lambda: [monitor.redis_pid],
            "postgres": (lambda: monitor.backends(db)) if db else list,
        }
        try:
            meter = CpuMeter(groups)
            reply = side.app.control.add_consumer(QUEUE, destination=[hostname], reply=True, timeout=10)
            if not reply:
                raise BenchError(f"{name}: the worker did not confirm add_consumer({QUEUE!r})")
            # The consumer adds the queue when its current BRPOP on the idle queue returns
            # (up to 1 s): the window opens when it takes the first message.
            deadline = time.monotonic() + 30
            while side.redis.llen(QUEUE) >= self.n:
                if time.monotonic() > deadline:
                    raise BenchError(f"{name}: the worker took no message after add_consumer")
                time.sleep(0.002)
            start = time.perf_counter()
            self.bench_cmds = 0
            cmds0 = monitor.redis_commands()
            meter.start()
            self.wait_side_done(side, hostname, timeout=max(120.0, self.n * 0.5))
            drain_seconds = time.perf_counter() - start
            cpu = meter.stop()
            cmds1 = monitor.redis_commands()
        finally:
            self.worker.stop()
        commits2 = self.settled_commits(db)
        side.verify(handles)
        cpu["redis"] = max(0.0, cpu["redis"] - bg_cpu * drain_seconds)
        redis_cmds = max(0.0, cmds1 - cmds0 - 1 - self.bench_cmds - bg_cmds * drain_seconds)
        return DrainResult(
            name,
            self.n,
            enqueue_seconds,
            drain_seconds,
            self.n,
            cpu,
            redis_cmds,
            commits2 - commits1,
            commits1 - commits0,
        )

    def settled_commits(self, database: str | None) -> int:
        """The tracked database's commits, once the bench's own connections closed too."""
        if database is None:
            return 0
        lane = self.platform.connections.lane
        if lane is not None:
            lane.close()  # the submit's kept connection, back to the pool
        self.platform.engine.dispose()  # its backends exit and flush their statistics
        return self.monitor.settled_commits(database)

    def wait_side_done(self, side: CeleryDrainSide, hostname: str, timeout: float) -> None:
        """Poll the queue every 20 ms; once it is empty, ask the side whether it is done."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.counted_backlog(side.redis) and side.finished(hostname):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{side.name}: not drained after {timeout:.0f}s")
            self.worker.check()
            time.sleep(DRAIN_POLL)

    # -- drain mode: Procrastinate ---------------------------------------------------------

    def procrastinate_dsn(self) -> str:
        """The Procrastinate side's own database."""
        return f"{self.pg.rstrip('/')}/{PROCRASTINATE_DATABASE}"

    def prepare_procrastinate(self) -> None:
        """Create its database and apply its schema."""
        recreate_database(self.pg, PROCRASTINATE_DATABASE)
        with sync_procrastinate(self.procrastinate_dsn()) as app:
            app.schema_manager.apply_schema()

    def drain_procrastinate(self, run: int) -> DrainResult:
        """One drain run of Procrastinate: defer N jobs, then start its workers."""
        import psycopg

        monitor, db, dsn = self.monitor, PROCRASTINATE_DATABASE, self.procrastinate_dsn()
        commits0 = monitor.settled_commits(db)
        with sync_procrastinate(dsn):
            deferrer = procrastinate_noop.configure()
            start = time.perf_counter()
            fan_out(self.enqueue_threads, self.n, lambda i: deferrer.defer(n=i))
            enqueue_seconds = time.perf_counter() - start
        analyze(dsn)
        commits1 = monitor.settled_commits(db)
        bg_cmds, bg_cpu = monitor.background()

        poll = psycopg.connect(dsn, autocommit=True)
        poll_pid = int(poll.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        polls = 0

        def count(sql: str) -> int:
            nonlocal polls
            polls += 1
            return int(poll.execute(sql).fetchone()[0])  # type: ignore[index]

        done_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        before = count(done_sql)
        workers = self.start_procrastinate_workers(run, dsn)
        try:
            meter = CpuMeter(
                {
                    "worker": lambda: [p for w in workers for p in process_tree(w.pid)],
                    "redis": lambda: [monitor.redis_pid],
                    "postgres": lambda: [p for p in monitor.backends(db) if p != poll_pid],
                }
            )
            deadline = time.monotonic() + 60
            while count("SELECT count(*) FROM procrastinate_workers") < PROCRASTINATE_PROCESSES:
                if time.monotonic() > deadline:
                    raise BenchError(f"procrastinate workers did not register; see {self.home / 'logs'}")
                check_procs(workers)
                time.sleep(0.005)
            cmds0 = monitor.redis_commands()
            meter.start()
            start = time.perf_counter()
            done_at_start = count(done_sql) - before
            deadline = time.monotonic() + max(120.0, self.n * 0.5)
            while count("SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"):
                if time.monotonic() > deadline:
                    raise BenchError("procrastinate: not drained in time")
                check_procs(workers)
                time.sleep(DRAIN_POLL)
            drain_seconds = time.perf_counter() - start
            cpu = meter.stop()
            cmds1 = monitor.redis_commands()
            succeeded = count(done_sql) - before
        finally:
            stop_procs(workers)
        bad = count("SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'")
        poll.close()
        commits2 = monitor.settled_commits(db)
        if succeeded != self.n or bad:
            raise BenchError(f"procrastinate: {succeeded} of {self.n} jobs succeeded, {bad} did not")
        cpu["redis"] = max(0.0, cpu["redis"] - bg_cpu * drain_seconds)
        redis_cmds = max(0.0, cmds1 - cmds0 - 1 - bg_cmds * drain_seconds)
        # The poll connection's own transactions are not the side's.
        return DrainResult(
            "procrastinate",
            self.n,
            enqueue_seconds,
            drain_seconds,
            self.n - done_at_start,
            cpu,
            redis_cmds,
            commits2 - commits1 - polls,
            commits1 - commits0,
        )

    def start_procrastinate_workers(self, run: int, dsn: str) -> list[subprocess.Popen[bytes]]:
        """``procrastinate worker`` processes on QUEUE, logs in the bench's home."""
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, PROCRASTINATE_DSN_ENV: dsn, "PYTHONPATH": pythonpath}
        procs = []
        for i in range(PROCRASTINATE_PROCESSES):
            with open(logs / f"procrastinate-{run}-{i}.log", "ab") as out:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "procrastinate",
                            "--app",
                            PROCRASTINATE_APP,
                            "worker",
                            "-q",
                            QUEUE,
                            "-c",
                            str(PROCRASTINATE_CONCURRENCY),
                            "-n",
                            f"bench-{run}-{i}",
                        ],
                        env=env,
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        return procs

    # -- drain mode: the whole thing --------------------------------------------------------

    def run_drain(self, runs: int, sides: Sequence[str]) -> dict[str, DrainFigures]:
        """Interleave ``runs`` drain runs per side; per side, each figure's median."""
        if "procrastinate" in sides:
            self.prepare_procrastinate()
        for run in range(runs):
            for side in sides:
                if side == "procrastinate":
                    result = self.drain_procrastinate(run)
                else:
                    result = self.drain_celery(side, run)
                self.drains.append(result)
                log(
                    f"drain run {run + 1}/{runs} {side:13s}: enqueue {result.enqueue_per_s:7.1f}/s  "
                    f"drain {result.drain_per_s:7.1f}/s  cpu us/job worker {result.cpu_us('worker'):6.0f} "
                    f"redis {result.cpu_us('redis'):5.0f} pg {result.cpu_us('postgres'):5.0f}  "
                    f"redis cmds/job {result.redis_cmds_per_job:5.1f}  commits/job "
                    f"{result.commits_per_job:4.2f} (enqueue {result.enqueue_commits / result.n:4.2f})"
                )
        return {side: median_drain([r for r in self.drains if r.side == side]) for side in sides}

    # -- enqueue mode ------------------------------------------------------------------------

    def run_enqueue(self, runs: int, sides: Sequence[str], threads: Sequence[int]) -> dict[str, float]:
        """Enqueue ``n`` jobs per side with no worker, with 1 and with 4 threads, interleaved;
        per ``<side>_<threads>t``, the median jobs/s. Each side's DB is emptied after."""
        rates: dict[str, list[float]] = {}
        for _ in range(runs):
            for count in threads:
                for name in sides:
                    if name == "procrastinate":
                        continue
                    side = self.celery_side(name)
                    side.redis.flushdb()
                    start = time.perf_counter()
                    fan_out(count, self.n, side.enqueue)
                    rate = self.n / (time.perf_counter() - start)
                    rates.setdefault(f"{name}_{count}t", []).append(rate)
                    log(f"enqueue {name:12s} {count} thread(s): {rate:7.1f}/s")
                    side.redis.flushdb()
                    if name == "tracked":
                        self.forget_jobs()  # their messages are gone: no row may wait for them
        return {key: statistics.median(values) for key, values in rates.items()}


@dataclass
class DrainFigures:
    """Medians of one side's drain runs, figure by figure."""

    enqueue_per_s: float
    drain_per_s: float
    cpu_us: dict[str, float]
    redis_cmds_per_job: float
    commits_per_job: float
    enqueue_commits_per_job: float

    @property
    def cpu_us_total(self) -> float:
        return sum(self.cpu_us.values())


def median_drain(results: Sequence[DrainResult]) -> DrainFigures:
    """Each figure's median over ``results`` (one side's runs)."""
    med = statistics.median
    return DrainFigures(
        enqueue_per_s=med(r.enqueue_per_s for r in results),
        drain_per_s=med(r.drain_per_s for r in results),
        cpu_us={g: med(r.cpu_us(g) for r in results) for g in ("worker", "redis", "postgres")},
        redis_cmds_per_job=med(r.redis_cmds_per_job for r in results),
        commits_per_job=med(r.commits_per_job for r in results),
        enqueue_commits_per_job=med(r.enqueue_commits / r.n for r in results),
    )


@contextlib.contextmanager
def sync_procrastinate(dsn: str) -> Iterator[Any]:
    """:data:`procrastinate_app` with a synchronous connector to ``dsn``, open."""
    connector = procrastinate.SyncPsycopgConnector(conninfo=dsn)
    with procrastinate_app.replace_connector(connector) as app, app.open():
        yield app


def analyze(dsn: str) -> None:
    """``ANALYZE`` a side's database after the enqueue, as autovacuum would in steady state:
    the planner then knows the queue is full (both Postgres sides get it)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE")


def check_procs(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Fail fast when a worker process died."""
    for proc in procs:
        if proc.poll() is not None:
            raise BenchError(f"a procrastinate worker exited with {proc.returncode}")


def stop_procs(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (graceful), then SIGKILL after 30 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def redis_url_of(redis: Redis) -> str:
    """The URL a client was made from (``Redis.from_url`` keeps host, port and DB)."""
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


T = TypeVar("T")


def fan_out(threads: int, count: int, fn: Callable[[int], T]) -> list[T]:
    """``[fn(i) for i in range(count)]``, spread over ``threads`` threads, in order.

    Both sides submit the same way, like a web app with several request threads would.
    """
    if threads <= 1:
        return [fn(i) for i in range(count)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, range(count), chunksize=max(1, count // (threads * 4))))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=FULL_N, help=f"jobs per run and side (default {FULL_N})")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="pool slots (default 4)")
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument(
        "--submitters", type=int, default=4, help="submitting threads, concurrent mode (default 4)"
    )
    parser.add_argument(
        "--enqueue-threads", type=int, default=1, help="enqueueing threads, drain mode (default 1)"
    )
    parser.add_argument("--mode", choices=("all", "drain", "enqueue", "concurrent"), default="all")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help=f"drain sides, comma-separated (default {','.join(SIDES)})"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 1 run")
    size.add_argument("--full", action="store_true", help=f"n={FULL_N}, 3 runs (the default)")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.runs = SMOKE_N, 1
    if args.full:
        args.n, args.runs = FULL_N, 3
    if min(args.n, args.runs, args.concurrency, args.submitters, args.enqueue_threads) < 1:
        parser.error("--n, --runs, --concurrency, --submitters and --enqueue-threads must be positive")
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := set(args.sides) - set(SIDES):
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if "procrastinate" in args.sides and procrastinate is None:
        log("procrastinate is not installed (pip install -e '.[bench]'): its side is skipped")
        args.sides.remove("procrastinate")
    if not 0 <= args.redis_db <= 13:
        parser.error("--redis-db must leave room for two more DBs (same_config, default)")
    return args


def print_drain(figures: dict[str, DrainFigures], configs: dict[str, str]) -> None:
    """The drain mode's ``name=value`` lines."""
    if figures and procrastinate is None:
        print("procrastinate_config=\"skipped: not installed (pip install -e '.[bench]')\"")
    for side, fig in figures.items():
        print(f'{side}_config="{configs[side]}"')
        print(f"{side}_enqueue_per_s={fig.enqueue_per_s:.1f}")
        print(f"{side}_drain_per_s={fig.drain_per_s:.1f}")
        print(f"{side}_cpu_us_per_job={fig.cpu_us_total:.0f}")
        for group in ("worker", "redis", "postgres"):
            print(f"{side}_cpu_us_per_job_{group}={fig.cpu_us[group]:.0f}")
        print(f"{side}_redis_cmds_per_job={fig.redis_cmds_per_job:.1f}")
        print(f"{side}_commits_per_job={fig.commits_per_job:.2f}")
        print(f"{side}_enqueue_commits_per_job={fig.enqueue_commits_per_job:.2f}")
    tracked = figures.get("tracked")
    if tracked is None:
        return
    for other in ("default", "same_config", "procrastinate"):
        if other in figures:
            print(f"drain_ratio_vs_{other}={tracked.drain_per_s / figures[other].drain_per_s:.3f}")
    if "same_config" in figures:
        print(f"cpu_ratio_vs_same_config={tracked.cpu_us_total / figures['same_config'].cpu_us_total:.3f}")


def print_enqueue(rates: dict[str, float], fsync: float | None) -> None:
    """The enqueue mode's ``name=value`` lines: jobs/s per side and thread count, the
    tracked side's ratios, and the disk's flush rate the synchronous submit waits on."""
    for key, rate in rates.items():
        print(f"{key.rsplit('_', 1)[0]}_enqueue_per_s_{key.rsplit('_', 1)[1]}={rate:.1f}")
    for count in ENQUEUE_THREADS:
        tracked, same = rates.get(f"tracked_{count}t"), rates.get(f"same_config_{count}t")
        if tracked and same:
            print(f"enqueue_ratio_{count}t_vs_same_config={tracked / same:.3f}")
    if fsync is not None:
        print(f"pg_test_fsync_fdatasync_ops_per_s={fsync:.0f}")


def fsync_rate() -> float | None:
    """``pg_test_fsync``'s fdatasync rate (one 8 kB write per flush, Postgres's default
    ``wal_sync_method`` on Linux) on the disk of the bench's temporary directory: the
    ceiling of unbatched synchronous commits; None without the tool."""
    import glob
    import re
    import tempfile

    tools = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_test_fsync"))
    if not tools:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [tools[-1], "-s", "1", "-f", str(Path(tmp) / "fsync.test")],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    match = re.search(r"fdatasync\s+([\d.]+) ops/sec", out)
    return float(match.group(1)) if match else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    from redis import Redis

    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-")
    redis_url, database_url, home = services.redis_url, services.database_url, services.home
    base = args.redis.rstrip("/")
    raw_redis = Redis.from_url(f"{base}/{args.redis_db + 1}")
    default_redis = Redis.from_url(f"{base}/{args.redis_db + 2}")
    bench: Bench | None = None
    drain: dict[str, DrainFigures] = {}
    concurrent: tuple[float, float] | None = None
    enqueue: dict[str, float] = {}
    configs = side_configs()
    try:
        platform = open_platform()
        settings = platform.settings
        assert settings.database_url
        configure_raw_app(settings.with_urls(redis_url_of(raw_redis), settings.database_url))
        configure_default_app(redis_url_of(default_redis))
        bench = Bench(
            platform=platform,
            redis=services.redis,
            raw_redis=raw_redis,
            default_redis=default_redis,
            pg=args.pg,
            database=args.database,
            n=args.n,
            concurrency=args.concurrency,
            home=home,
            submitters=args.submitters,
            enqueue_threads=args.enqueue_threads,
        )
        log(
            f"throughput: mode={args.mode} n={args.n} runs={args.runs} concurrency={bench.concurrency} "
            f"redis={redis_url} (+{args.redis_db + 1}, +{args.redis_db + 2}) db={database_url} home={home}"
        )
        for side in args.sides:
            log(f"  {side}: {configs[side]}")
        raw_redis.flushdb()
        default_redis.flushdb()
        if args.mode in ("all", "drain"):
            drain = bench.run_drain(args.runs, args.sides)
        if args.mode in ("all", "enqueue"):
            enqueue = bench.run_enqueue(args.runs, args.sides, ENQUEUE_THREADS)
        if args.mode in ("all", "concurrent"):
            services.redis.flushdb()
            raw_redis.flushdb()
            concurrent = bench.run_concurrent(args.runs)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            try:
                bench.stop_worker()
            except BenchError as exc:
                log(f"cleanup: {exc}")
            bench.monitor.close()
            bench.platform.reset()
            bench.platform.engine.dispose()
        raw_app.close()
        default_app.close()
        for extra in (raw_redis, default_redis):
            extra.flushdb()
            extra.close()
        recreate_database(args.pg, PROCRASTINATE_DATABASE, create=False)
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    print_drain(drain, configs)
    print_enqueue(enqueue, fsync_rate() if args.mode in ("all", "enqueue") and not args.smoke else None)
    if concurrent is not None:
        tracked, raw = concurrent
        print(f"tracked_jobs_per_s={tracked:.1f}")
        print(f"raw_celery_tasks_per_s={raw:.1f}")
        print(f"ratio={tracked / raw:.3f}")
    print(f"n={args.n}")
    print(f"runs={args.runs}")
    print(f"concurrency={args.concurrency}")
    return 0


if __name__ == "__main__":
    # Run as ``python -m bench.throughput`` or as a file: either way the worker must import
    # the very module that registered the raw task, so hand over to ``bench.throughput``.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.throughput import main as bench_main

    raise SystemExit(bench_main())
