"""Throughput of Conveyor's tracked lifecycle against raw Celery, in one run.

Both sides use the same Redis, the same ``config/`` settings (one Celery config dict from
:func:`conveyor.celeryconfig.celery_config`), the same queue ``demo``, a real
``celery worker -P prefork`` subprocess with the same concurrency and flags, and the same
amount of warm-up. Only one worker runs at a time; runs are interleaved (tracked, raw,
tracked, raw, ...) and the median per side is reported.

* tracked: ``platform.submit("conveyor.demo.noop", {"n": i})`` for ``i in range(N)``, timed
  from the first submit until a ``COUNT`` of the DB says every job is terminal (polled every
  50 ms); every job must end ``succeeded``.
* raw: a plain Celery task (no Conveyor base class) on a separate app object,
  ``noop.apply_async(kwargs={"n": i}, queue="demo")``, timed from the first publish until
  every result is in the Redis result backend.

Usage::

    .venv/bin/python -m bench.throughput                 # N=5000, 3 runs per side
    .venv/bin/python -m bench.throughput --smoke         # CI: N=50, 1 run
    .venv/bin/python -m bench.throughput --n 2000 --concurrency 2 --runs 5

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs:
``tracked_jobs_per_s``, ``raw_celery_tasks_per_s``, ``ratio``, ``n``, ``runs``.

Importing this module is cheap and reads no settings, except in a worker process started
by the bench (``celery -A bench.throughput:raw_app``), where ``CONVEYOR_REDIS_URL`` is set
and :data:`raw_app` configures itself from the environment exactly like ``config.celery_app``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from celery import Celery
from celery.result import AsyncResult

from bench.common import (
    POLL_INTERVAL,
    ROOT,
    BenchError,
    BenchWorker,
    RunResult,
    add_service_args,
    backlog,
    check_all_succeeded,
    log,
    open_platform,
    prepare,
    wait_drained,
)
from config.queues import DEFAULT_QUEUE, QUEUES
from conveyor.celeryconfig import celery_config

if TYPE_CHECKING:
    from redis import Redis

    from conveyor.platform import Platform
    from conveyor.settings import ConveyorSettings

QUEUE = "demo"
TRACKED_STAGE = "conveyor.demo.noop"
RAW_TASK = "bench.raw.noop"
RAW_APP = "bench.throughput:raw_app"
REDIS_DB = 12
DATABASE = "conveyor_bench"
SMOKE_N = 50
IDLE_PAUSE = 0.5


# -- the raw side: a plain Celery app and task, nothing from Conveyor's runtime ----------

raw_app = Celery("conveyor_bench_raw")


def configure_raw_app(settings: ConveyorSettings) -> None:
    """Give :data:`raw_app` exactly the Celery config the deployment's app gets."""
    raw_app.conf.update(celery_config(settings, queues=QUEUES, default_queue=DEFAULT_QUEUE))


@raw_app.task(name=RAW_TASK)  # type: ignore[untyped-decorator]
def noop(n: int) -> dict[str, int]:
    """The raw counterpart of ``conveyor.demo.noop``."""
    return {"n": n}


if os.environ.get("CONVEYOR_REDIS_URL"):
    # A worker process: same environment as the tracked worker (conveyor.procs.service_env).
    # A fresh Settings(), not the cached get_settings(): in the bench process this runs at
    # import, before main() sets the environment (main() configures the app again).
    from config.settings import Settings

    configure_raw_app(Settings())


# -- measurements ------------------------------------------------------------------------


@dataclass
class Bench:
    """Everything one benchmark invocation needs: services, platform, options."""

    platform: Platform
    redis: Redis
    n: int
    concurrency: int
    home: Path
    submitters: int = 4
    results: list[RunResult] = field(default_factory=list)
    worker: BenchWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)

    # -- workers ---------------------------------------------------------------------

    def start_worker(self, side: str, run: int) -> str:
        """Start the worker of ``side`` (only one at a time) and wait until it answers."""
        settings, app = self.platform.settings, self.platform.app
        if side == "raw":
            settings, app = settings.model_copy(update={"app": RAW_APP}), raw_app
        return self.worker.start(
            settings, app, name=f"{side}-{run}", queues=[QUEUE], concurrency=self.concurrency
        )

    def stop_worker(self) -> None:
        """Warm-stop the running worker, after its last ack reached Redis."""
        if self.worker.proc is None:
            return
        try:
            self.wait_drained()
        finally:
            self.worker.stop()

    # -- queue hygiene ---------------------------------------------------------------

    def backlog(self) -> int:
        """Messages waiting in the queue plus delivered-but-unacked ones."""
        return backlog(self.redis, [QUEUE])

    def wait_drained(self, timeout: float = 30.0) -> None:
        """Wait until the queue and the unacked set are empty."""
        wait_drained(self.redis, [QUEUE], timeout)

    # -- tracked side ----------------------------------------------------------------

    def non_terminal(self) -> int:
        """Jobs not yet terminal (a COUNT by status; the status index answers it)."""
        from sqlalchemy import func, select

        from conveyor.db.schema import TERMINAL, jobs

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

    def submit_tracked(self, count: int) -> None:
        """Submit ``count`` no-op jobs through the platform, from ``submitters`` threads."""
        submit = self.platform.submit
        fan_out(self.submitters, count, lambda i: submit(TRACKED_STAGE, {"n": i}))

    def run_tracked(self, run: int) -> RunResult:
        """One timed tracked run with a fresh worker."""
        self.start_worker("tracked", run)
        try:
            warm = 2 * self.concurrency
            self.submit_tracked(warm)
            self.wait_terminal(timeout=60)
            self.wait_drained()
            time.sleep(IDLE_PAUSE)
            expected = self.platform_total() + self.n
            start = time.perf_counter()
            self.submit_tracked(self.n)
            submitted = time.perf_counter()
            self.wait_terminal(timeout=max(120.0, self.n * 0.2))
            end = time.perf_counter()
            check_all_succeeded(self.platform, expected)
        finally:
            self.stop_worker()
        return RunResult("tracked", self.n, end - start, submitted - start)

    def platform_total(self) -> int:
        """How many jobs the database holds."""
        from sqlalchemy import func, select

        from conveyor.db.schema import jobs

        with self.platform.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())

    # -- raw side --------------------------------------------------------------------

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
        """One timed raw-Celery run with a fresh worker."""
        self.start_worker("raw", run)
        try:
            self.collect_raw(self.submit_raw(2 * self.concurrency), timeout=60)
            self.wait_drained()
            time.sleep(IDLE_PAUSE)
            start = time.perf_counter()
            results = self.submit_raw(self.n)
            submitted = time.perf_counter()
            self.collect_raw(results, timeout=max(120.0, self.n * 0.2))
            end = time.perf_counter()
        finally:
            self.stop_worker()
        return RunResult("raw", self.n, end - start, submitted - start)

    # -- the whole thing -------------------------------------------------------------

    def run(self, runs: int) -> tuple[float, float]:
        """Interleave ``runs`` runs per side; return the median rates (tracked, raw)."""
        sides: list[tuple[str, Callable[[int], RunResult]]] = [
            ("tracked", self.run_tracked),
            ("raw", self.run_raw),
        ]
        for run in range(runs):
            for side, fn in sides:
                if self.backlog():
                    raise BenchError(f"queue {QUEUE!r} not empty before the {side} run")
                result = fn(run)
                self.results.append(result)
                log(
                    f"run {run + 1}/{runs} {side:7s}: {result.per_second:8.1f}/s "
                    f"({result.seconds:.2f}s total, {result.submit_seconds:.2f}s submitting)"
                )
        tracked = statistics.median(r.per_second for r in self.results if r.side == "tracked")
        raw = statistics.median(r.per_second for r in self.results if r.side == "raw")
        return tracked, raw


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
    parser.add_argument("--n", type=int, default=5000, help="jobs/tasks per run (default 5000)")
    parser.add_argument("--concurrency", type=int, default=None, help="pool size (default: the setting)")
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument(
        "--submitters", type=int, default=4, help="submitting threads, both sides (default 4)"
    )
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 1 run")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.runs = SMOKE_N, 1
    if args.n < 1 or args.runs < 1 or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--n, --runs and --concurrency must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-")
    redis_url, database_url, home = services.redis_url, services.database_url, services.home
    redis = services.redis
    bench: Bench | None = None
    try:
        platform = open_platform()
        configure_raw_app(platform.settings)
        bench = Bench(
            platform=platform,
            redis=redis,
            n=args.n,
            concurrency=args.concurrency or platform.settings.worker_concurrency,
            home=home,
            submitters=args.submitters,
        )
        log(
            f"throughput: n={args.n} runs={args.runs} concurrency={bench.concurrency} "
            f"redis={redis_url} db={database_url} home={home}"
        )
        tracked, raw = bench.run(args.runs)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            try:
                bench.stop_worker()
            except BenchError as exc:
                log(f"cleanup: {exc}")
            bench.platform.reset()
        raw_app.close()
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    print(f"tracked_jobs_per_s={tracked:.1f}")
    print(f"raw_celery_tasks_per_s={raw:.1f}")
    print(f"ratio={tracked / raw:.3f}")
    print(f"n={args.n}")
    print(f"runs={args.runs}")
    return 0


if __name__ == "__main__":
    # Run as ``python -m bench.throughput`` or as a file: either way the worker must import
    # the very module that registered the raw task, so hand over to ``bench.throughput``.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.throughput import main as bench_main

    raise SystemExit(bench_main())
