"""Latency of one job on an idle worker, beside plain Celery (issue #16, latency).

Two idle workers run side by side on a private redis-server (started here on a free port):
``conveyor worker`` (4 slots) on DB 0 with the bench's own database
``conveyor_bench_latency`` (dropped and created), and plain ``celery worker`` (4 slots) of
``bench.throughput:raw_app`` (Celery with the frozen same-config of
:mod:`bench.frozen_config`, whose Redis result backend ``AsyncResult.get()`` needs) on DB 1.
Jobs go one at a time, alternating sides, after a warm-up of each:

* ``submit_to_start``: from just before ``platform.submit("conveyor.demo.noop", ...)`` to
  the job's ``started_at`` (its claim, the last statement before the body runs; the
  database's clock, which on this host is the bench's clock);
* ``submit_to_wait``: from just before the submit until ``JobHandle.wait()`` returned;
* ``celery_apply_to_get``: from just before ``apply_async`` until ``AsyncResult.get()``
  returned.

p50 and p99 in ms of each, ``--n`` jobs per side (300; ``--smoke``: 30). Progress goes to
stderr; stdout carries only ``name=value`` lines.

Usage::

    .venv/bin/python -m bench.latency
    .venv/bin/python -m bench.latency --smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import celery

from bench.common import DEFAULT_PG, ROOT, BenchError, BenchWorker, log, open_platform, recreate_database

if TYPE_CHECKING:
    from celery import Celery

    from conveyor.platform import Platform
    from conveyor.settings import ConveyorSettings

DATABASE = "conveyor_bench_latency"
STAGE = "conveyor.demo.noop"
QUEUE = "demo"
CONCURRENCY = 4
FULL_N = 300
SMOKE_N = 30
WARM = 10
TIMEOUT = 30.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


def started_at(platform: Platform, job_id: str) -> float:
    """The job's ``started_at`` (its claim) as a Unix timestamp."""
    from sqlalchemy import select

    from conveyor.store.db.schema import jobs

    with platform.engine.connect() as conn:
        value = conn.execute(select(jobs.c.started_at).where(jobs.c.id == job_id)).scalar_one()
    if value is None:
        raise BenchError(f"job {job_id} has no started_at")
    return float(value.timestamp())


def conveyor_job(platform: Platform, i: int) -> tuple[float, float]:
    """One job through Conveyor: (submit → start, submit → wait) in seconds."""
    t0 = time.time()
    start = time.perf_counter()
    handle = platform.submit(STAGE, {"n": i})
    status = handle.wait(timeout=TIMEOUT)
    waited = time.perf_counter() - start
    if status != "succeeded":
        raise BenchError(f"job {handle.id} ended {status}")
    return started_at(platform, handle.id) - t0, waited


def celery_task(i: int) -> float:
    """One task through plain Celery: apply_async → get, in seconds."""
    from bench.throughput import noop

    start = time.perf_counter()
    result = noop.apply_async(kwargs={"n": i}, queue=QUEUE)
    value = result.get(timeout=TIMEOUT)
    elapsed = time.perf_counter() - start
    if value != {"n": i}:
        raise BenchError(f"celery task returned {value!r}")
    return elapsed


def start_workers(
    platform: Platform,
    celery_settings: ConveyorSettings,
    raw: Celery,
    tracked: BenchWorker,
    plain: BenchWorker,
) -> None:
    """Both idle workers, each answering a ping."""
    tracked.start(
        platform.settings, platform.app, name="latency-conveyor", queues=[QUEUE], concurrency=CONCURRENCY
    )
    plain.start(celery_settings, raw, name="latency-celery", queues=[QUEUE], concurrency=CONCURRENCY)


def measure(platform: Platform, n: int) -> dict[str, list[float]]:
    """``n`` jobs per side, alternating, after ``WARM`` of each; seconds per figure."""
    for i in range(WARM):
        conveyor_job(platform, i)
        celery_task(i)
    out: dict[str, list[float]] = {"submit_to_start": [], "submit_to_wait": [], "celery_apply_to_get": []}
    for i in range(n):
        to_start, to_wait = conveyor_job(platform, i)
        out["submit_to_start"].append(to_start)
        out["submit_to_wait"].append(to_wait)
        out["celery_apply_to_get"].append(celery_task(i))
        if (i + 1) % 50 == 0:
            log(f"  {i + 1}/{n}")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description="latency of one job on an idle worker")
    parser.add_argument("--smoke", action="store_true", help=f"CI: {SMOKE_N} jobs per side")
    parser.add_argument("--n", type=int, default=None, help=f"jobs per side (default {FULL_N})")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--database", default=DATABASE, help="Postgres database (dropped and created)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    from conveyor.delivery.embedded import start_redis

    args = parse_args(argv)
    n = args.n or (SMOKE_N if args.smoke else FULL_N)
    home = Path(tempfile.mkdtemp(prefix="conveyor-bench-latency-"))
    tracked, plain = BenchWorker(home), BenchWorker(home)
    platform: Platform | None = None
    server = start_redis(home)
    base = f"redis://127.0.0.1:{server.port}"
    try:
        os.environ["CONVEYOR_REDIS_URL"] = f"{base}/0"
        os.environ["CONVEYOR_DATABASE_URL"] = f"{args.pg.rstrip('/')}/{args.database}"
        os.environ["CONVEYOR_HOME"] = str(home)
        recreate_database(args.pg, args.database)
        platform = open_platform()
        from bench.throughput import RAW_APP, configure_raw_app, raw_app

        settings = platform.settings
        assert settings.database_url
        celery_settings = settings.with_urls(f"{base}/1", settings.database_url).model_copy(
            update={"app": RAW_APP}
        )
        configure_raw_app(celery_settings)
        log(f"latency: n={n} redis={base} (0: conveyor, 1: celery) db={args.database} home={home}")
        start_workers(platform, celery_settings, raw_app, tracked, plain)
        figures = measure(platform, n)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        for worker in (tracked, plain):
            try:
                worker.stop()
            except BenchError as exc:
                log(f"cleanup: {exc}")
        if platform is not None:
            platform.reset()
            platform.engine.dispose()
        server.stop()
        recreate_database(args.pg, args.database, create=False)
    shutil.rmtree(home, ignore_errors=True)
    for name, values in figures.items():
        print(f"{name}_p50_ms={percentile(values, 0.5) * 1000:.2f}")
        print(f"{name}_p99_ms={percentile(values, 0.99) * 1000:.2f}")
        print(f"{name}_mean_ms={statistics.fmean(values) * 1000:.2f}")
    print(
        "conveyor_config=conveyor worker prefork -c 4, conveyor.delivery.celeryconfig.celery_config() "
        f"of this checkout, platform.submit {STAGE}, JobHandle.wait(); start = the row's started_at (claim)"
    )
    print(
        f"celery_config=celery {celery.__version__} worker prefork -c 4, bench/frozen_config.py "
        "(late acks, prefetch off, events, redis result backend), apply_async + AsyncResult.get()"
    )
    print(f"n={n}")
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
