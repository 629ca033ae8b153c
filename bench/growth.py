"""Does a job cost more when the tables and the queue are big? (issue #16, growth)

Three figures, on a private redis-server (started here, on a free port) and the bench's own
database ``conveyor_bench_growth`` (dropped and created):

* **claim + completion cost**: ``jobs`` filled with 10k, 100k and then 1M terminal rows
  (``INSERT ... SELECT generate_series``, then ``ANALYZE`` as autovacuum would) beside 100k
  ``job_events``; at each size, ``Lane.claim`` + ``Lane.succeed`` of fresh queued jobs,
  sequentially on one pooled connection, each pair timed: ``claim_complete_us_<size>=``
  (p50), ``claim_complete_mean_us_<size>=`` and
  ``claim_complete_growth_<largest>_vs_<smallest>=`` (p50 over p50; goal ≤ 1.2).
* **drain from a backlog**: a backlog of 5k, then of 100k queued jobs (tables emptied in
  between), a real ``conveyor worker`` with 4 slots started on an idle queue and pointed at
  the full one (as ``bench/throughput.py`` does, so its boot is not timed); the window runs
  from its first message until ``--window`` (5k) jobs succeeded, i.e. the whole small
  backlog and the first 5k of the big one: ``drain_per_s_backlog_5k=``,
  ``drain_per_s_backlog_100k=`` and ``drain_ratio_100k_vs_5k=``. The backlog is enqueued
  fast: one job is submitted through the platform, its row is copied N times in one
  ``INSERT ... SELECT`` (each copy with its ``job.submitted`` event, marked published under
  the broker's epoch) and each copy's message is published through the platform's broker.
* **Redis bytes per queued job**: ``INFO memory`` ``used_memory`` after publishing the big
  backlog, less before, over N: ``redis_bytes_per_queued_job=`` (goal ≤ 2048).

``--smoke`` (CI, < 60 s): 1k and 10k rows, backlogs of 500 and 2k with a 500-job window.
Progress goes to stderr; stdout carries only ``name=value`` lines.

Usage::

    .venv/bin/python -m bench.growth            # full sizes
    .venv/bin/python -m bench.growth --smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    DEFAULT_PG,
    ROOT,
    BenchError,
    BenchWorker,
    log,
    open_platform,
    recreate_database,
)

if TYPE_CHECKING:
    from conveyor.platform import Platform

DATABASE = "conveyor_bench_growth"
STAGE = "conveyor.demo.noop"
QUEUE = "demo"
IDLE_QUEUE = "default"
CONCURRENCY = 4
FULL_SIZES = (10_000, 100_000, 1_000_000)
SMOKE_SIZES = (1_000, 10_000)
FULL_EVENTS = 100_000
SMOKE_EVENTS = 10_000
FULL_PAIRS = 2000
SMOKE_PAIRS = 300
WARM_PAIRS = 100
FULL_BACKLOGS = (5_000, 100_000)
SMOKE_BACKLOGS = (500, 2_000)
FULL_WINDOW = 5_000
SMOKE_WINDOW = 500
PUBLISH_THREADS = 4
FILL_CHUNK = 200_000


def label(n: int) -> str:
    """``10k``, ``1m``: a size as the output names it."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}m"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


# -- services ---------------------------------------------------------------------------------


@contextmanager
def private_redis(home: Path) -> Iterator[str]:
    """A redis-server of the bench's own on a free port (no other client's keys or
    commands in its figures); yields its URL (DB 0)."""
    from conveyor.delivery.embedded import start_redis

    server = start_redis(home)
    try:
        yield f"redis://127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def exec_sql(platform: Platform, sql: str, params: dict[str, Any] | None = None) -> None:
    """Run ``sql`` in one transaction with Conveyor's schema on the search path."""
    from sqlalchemy import text

    from conveyor.store.db.namespace import SCHEMA

    with platform.engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL search_path TO "{SCHEMA}"')
        conn.execute(text(sql), params or {})


def analyze(platform: Platform) -> None:
    """Fresh planner statistics, as autovacuum would have gathered them."""
    from conveyor.store.db.namespace import SCHEMA

    with platform.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f'VACUUM ANALYZE "{SCHEMA}".jobs, "{SCHEMA}".job_events')


def truncate(platform: Platform) -> None:
    """Empty the job tables (between figures)."""
    exec_sql(platform, "TRUNCATE jobs, job_events, dedup_keys, dedup_followers")


# -- claim + completion against table size ---------------------------------------------------

TERMINAL_ROWS = """
INSERT INTO jobs (id, stage, queue, status, priority, payload, attempts, uncounted, requeues,
                  max_attempts, run_at, options, created_at, updated_at, started_at, finished_at,
                  published_at, broker_epoch, flow_id, celery_task_id, result)
SELECT 'old-' || g, :stage, :queue,
       (ARRAY['succeeded','succeeded','succeeded','dead','cancelled','expired'])[1 + g % 6],
       0, '{"n": 1}', 1, 0, 0, 3, t, '{}', t, t, t, t, t, 'epoch-old', 'old-' || g, 'task-' || g,
       '{"n": 1}'
  FROM generate_series(CAST(:first AS integer), CAST(:last AS integer)) AS g,
       LATERAL (SELECT now() - (g % 10000) * interval '1 minute' AS t) AS c
"""

EVENT_ROWS = """
INSERT INTO job_events (seq, job_id, topic, body, created_at)
SELECT g, 'old-' || g, 'job.succeeded', '{"stage": "conveyor.demo.noop"}', now()
  FROM generate_series(1, CAST(:events AS integer)) AS g;
"""

COUNTER = """
INSERT INTO conveyor_counters (name, value) VALUES ('event_seq', CAST(:events AS bigint))
ON CONFLICT (name) DO UPDATE SET value = greatest(conveyor_counters.value, EXCLUDED.value)
"""

CLAIMABLE_ROWS = """
INSERT INTO jobs (id, stage, queue, status, priority, payload, attempts, uncounted, requeues,
                  max_attempts, run_at, options, created_at, updated_at, published_at,
                  broker_epoch, flow_id)
SELECT :prefix || g, :stage, :queue, 'queued', 0, '{"n": 2}', 0, 0, 0, 3,
       now() - interval '1 second', '{"ignore_result": true}', now(), now(), now(), 'epoch-b',
       :prefix || g
  FROM generate_series(1, CAST(:n AS integer)) AS g
"""


def fill_terminal(platform: Platform, have: int, want: int) -> None:
    """Grow ``jobs`` from ``have`` to ``want`` terminal rows, in chunks."""
    first = have + 1
    while first <= want:
        last = min(want, first + FILL_CHUNK - 1)
        exec_sql(platform, TERMINAL_ROWS, {"stage": STAGE, "queue": QUEUE, "first": first, "last": last})
        first = last + 1


def claim_complete(platform: Platform, size: int, pairs: int) -> list[float]:
    """Microseconds of each claim + succeed pair of ``pairs`` fresh queued jobs."""
    from conveyor.store.db.lane import Lane
    from conveyor.store.db.namespace import SCHEMA

    prefix = f"cc-{size}-"
    exec_sql(
        platform,
        CLAIMABLE_ROWS,
        {"prefix": prefix, "stage": STAGE, "queue": QUEUE, "n": pairs + WARM_PAIRS},
    )
    lane = Lane(platform.engine, SCHEMA)
    times: list[float] = []
    for i in range(1, pairs + WARM_PAIRS + 1):
        job_id = f"{prefix}{i}"
        start = time.perf_counter_ns()
        row = lane.claim(job_id, owner="bench-growth", task_id=job_id)
        if row is None:
            raise BenchError(f"claim of {job_id} found nothing to claim")
        if not lane.succeed(job_id, int(row["attempts"]), {"n": 2}, STAGE):
            raise BenchError(f"completion of {job_id} was fenced off")
        elapsed = (time.perf_counter_ns() - start) / 1000
        if i > WARM_PAIRS:
            times.append(elapsed)
    return times


def run_claim_complete(
    platform: Platform, sizes: Sequence[int], events: int, pairs: int
) -> dict[int, tuple[float, float]]:
    """(p50, mean) µs per claim + completion pair at each table size."""
    exec_sql(platform, EVENT_ROWS, {"events": events})
    exec_sql(platform, COUNTER, {"events": events})
    out: dict[int, tuple[float, float]] = {}
    have = 0
    for size in sizes:
        log(f"  filling jobs to {size:,} terminal rows ...")
        start = time.perf_counter()
        fill_terminal(platform, have, size)
        have = size
        analyze(platform)
        log(f"  filled in {time.perf_counter() - start:.1f}s; {pairs} claim+completion pairs ...")
        times = claim_complete(platform, size, pairs)
        out[size] = (statistics.median(times), statistics.fmean(times))
        log(f"  {label(size)}: p50 {out[size][0]:.0f} µs, mean {out[size][1]:.0f} µs")
    return out


# -- drain from a backlog -------------------------------------------------------------------

COPIES = """
WITH copies AS (
  INSERT INTO jobs (id, stage, queue, status, priority, payload, label, attempts, uncounted,
                    requeues, max_attempts, run_at, options, origin_task_id, celery_task_id,
                    published_at, broker_epoch, flow_id, owner, trace_context, created_at,
                    updated_at)
  SELECT n.id, t.stage, t.queue, 'queued', t.priority, jsonb_build_object('n', n.g), t.label, 0,
         0, 0, t.max_attempts, now(), t.options, n.id, n.id, now(), :epoch, n.id, t.owner,
         t.trace_context, now(), now()
    FROM jobs AS t,
         LATERAL (SELECT g, gen_random_uuid()::text AS id
                    FROM generate_series(1, CAST(:n AS integer)) AS g) AS n
   WHERE t.id = :template
  RETURNING id, stage
)
INSERT INTO job_events (job_id, topic, body, created_at)
SELECT id, 'job.submitted', jsonb_build_object('stage', stage), now() FROM copies
"""


def enqueue_backlog(platform: Platform, n: int) -> float:
    """``n`` queued jobs of ``STAGE``, each with its message in Redis; returns the bytes of
    Redis memory per queued message."""
    from sqlalchemy import select

    from conveyor.store.db.schema import jobs

    template = platform.submit(STAGE, {"n": 0}).id
    epoch = platform.broker.epoch(max_age=0)
    platform.redis.delete(QUEUE)  # the template's own message: the template is not counted
    exec_sql(platform, "DELETE FROM job_events WHERE job_id = :t", {"t": template})
    exec_sql(platform, COPIES, {"n": n, "epoch": epoch, "template": template})
    exec_sql(platform, "DELETE FROM jobs WHERE id = :t", {"t": template})
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs).where(jobs.c.status == "queued")).mappings())
    if len(rows) != n:
        raise BenchError(f"expected {n} queued jobs, found {len(rows)}")
    redis = platform.redis
    before = int(redis.info("memory")["used_memory"])
    publish = platform.broker.publish

    def send(row: Any) -> None:
        publish(
            stage=row["stage"],
            job_id=row["id"],
            queue=row["queue"],
            payload=row["payload"],
            options=row["options"],
            task_id=row["celery_task_id"],
            trace_context=row["trace_context"],
        )

    start = time.perf_counter()
    with ThreadPoolExecutor(PUBLISH_THREADS) as pool:
        list(pool.map(send, rows, chunksize=256))
    queued = int(redis.llen(QUEUE))
    after = int(redis.info("memory")["used_memory"])
    if queued != n:
        raise BenchError(f"expected {n} messages in {QUEUE!r}, found {queued}")
    log(f"  {n:,} jobs inserted and published ({n / (time.perf_counter() - start):.0f} messages/s)")
    return (after - before) / n


def succeeded(platform: Platform) -> int:
    """How many jobs succeeded (an index-only count on the status index)."""
    from sqlalchemy import func, select

    from conveyor.store.db.schema import SUCCEEDED, jobs

    with platform.engine.connect() as conn:
        q = select(func.count()).select_from(jobs).where(jobs.c.status == SUCCEEDED)
        return int(conn.execute(q).scalar_one())


def drain(platform: Platform, worker: BenchWorker, backlog: int, window: int) -> tuple[float, float]:
    """Jobs per second of a fresh 4-slot worker over the first ``window`` jobs of a backlog
    of ``backlog``, and Redis bytes per queued message."""
    truncate(platform)
    bytes_per_job = enqueue_backlog(platform, backlog)
    analyze(platform)
    redis = platform.redis
    hostname = worker.start(
        platform.settings,
        platform.app,
        name=f"drain-{label(backlog)}",
        queues=[IDLE_QUEUE],
        concurrency=CONCURRENCY,
    )
    try:
        if not platform.app.control.add_consumer(QUEUE, destination=[hostname], reply=True, timeout=10):
            raise BenchError("the worker did not confirm add_consumer")
        deadline = time.monotonic() + 30
        while redis.llen(QUEUE) >= backlog:
            if time.monotonic() > deadline:
                raise BenchError("the worker took no message after add_consumer")
            time.sleep(0.002)
        start = time.perf_counter()
        deadline = time.monotonic() + max(120.0, window * 0.5)
        while (done := succeeded(platform)) < window:
            if time.monotonic() > deadline:
                raise BenchError(f"only {done} of {window} jobs done after {window * 0.5:.0f}s")
            worker.check()
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        # Take no more messages: the warm stop then waits only for the jobs in hand.
        platform.app.control.cancel_consumer(QUEUE, destination=[hostname], reply=True, timeout=10)
        redis.delete(QUEUE)  # the rest of the backlog is not measured
    finally:
        worker.stop()
    rate = done / seconds
    log(f"  backlog {label(backlog)}: {done} jobs in {seconds:.1f}s = {rate:.1f}/s")
    return rate, bytes_per_job


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="CI sizes (< 60 s)")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--database", default=DATABASE, help="Postgres database (dropped and created)")
    parser.add_argument(
        "--skip", choices=("claim", "drain"), action="append", default=[], help="leave a figure out"
    )
    parser.add_argument(
        "--backlogs", type=int, nargs=2, default=None, help="the two backlog sizes of the drain"
    )
    parser.add_argument("--window", type=int, default=None, help="jobs timed of each drain")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else FULL_SIZES
    events = SMOKE_EVENTS if args.smoke else FULL_EVENTS
    pairs = SMOKE_PAIRS if args.smoke else FULL_PAIRS
    backlogs = tuple(args.backlogs or (SMOKE_BACKLOGS if args.smoke else FULL_BACKLOGS))
    window = args.window or (SMOKE_WINDOW if args.smoke else FULL_WINDOW)
    if window > min(backlogs):
        raise SystemExit("--window must not exceed the smaller backlog")
    home = Path(tempfile.mkdtemp(prefix="conveyor-bench-growth-"))
    costs: dict[int, tuple[float, float]] = {}
    drains: dict[int, float] = {}
    bytes_per_job = 0.0
    worker = BenchWorker(home)
    platform: Platform | None = None
    try:
        with private_redis(home) as redis_url:
            os.environ["CONVEYOR_REDIS_URL"] = redis_url
            os.environ["CONVEYOR_DATABASE_URL"] = f"{args.pg.rstrip('/')}/{args.database}"
            os.environ["CONVEYOR_HOME"] = str(home)
            recreate_database(args.pg, args.database)
            platform = open_platform()
            log(f"growth: redis={redis_url} db={args.database} home={home} smoke={args.smoke}")
            if "claim" not in args.skip:
                log(f"claim + completion with {', '.join(label(s) for s in sizes)} rows in jobs:")
                costs = run_claim_complete(platform, sizes, events, pairs)
            if "drain" not in args.skip:
                truncate(platform)
                log(f"drain of a {CONCURRENCY}-slot worker, window {window:,} jobs:")
                for n in backlogs:
                    drains[n], per_job = drain(platform, worker, n, window)
                    bytes_per_job = per_job  # the biggest backlog's figure is printed
            platform.reset()
            platform.engine.dispose()
            platform = None
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        try:
            worker.stop()
        finally:
            if platform is not None:
                platform.reset()
                platform.engine.dispose()
            recreate_database(args.pg, args.database, create=False)
    shutil.rmtree(home, ignore_errors=True)
    print_figures(costs, drains, bytes_per_job, window)
    return 0


def print_figures(
    costs: dict[int, tuple[float, float]], drains: dict[int, float], bytes_per_job: float, window: int
) -> None:
    """The ``name=value`` lines."""
    for size, (p50, mean) in costs.items():
        print(f"claim_complete_us_{label(size)}={p50:.1f}")
        print(f"claim_complete_mean_us_{label(size)}={mean:.1f}")
    if len(costs) > 1:
        small, big = min(costs), max(costs)
        print(f"claim_complete_growth_{label(big)}_vs_{label(small)}={costs[big][0] / costs[small][0]:.3f}")
    for n, rate in drains.items():
        print(f"drain_per_s_backlog_{label(n)}={rate:.1f}")
    if len(drains) > 1:
        small, big = min(drains), max(drains)
        print(f"drain_ratio_{label(big)}_vs_{label(small)}={drains[big] / drains[small]:.3f}")
        print(f"redis_bytes_per_queued_job={bytes_per_job:.0f}")
        print(f"drain_window={window}")
        print(f"concurrency={CONCURRENCY}")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
