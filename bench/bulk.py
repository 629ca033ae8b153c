"""Bulk submit (issue #16): ``submit_many()`` against a raw pipelined kombu publish of the
same messages, and against Procrastinate's ``batch_defer``, in one run.

No worker runs. Each side enqueues N jobs of the benchmark's no-op, in batches of
``--batch-size`` (default 1000), and is timed from its first call to its last return.
The two Redis sides run back to back ``--runs`` times (default 3; raw, bulk, raw, ...):
medians are printed, and the ratio is the median of each run's own ratio (the machine
may be shared). Procrastinate runs once, last:

* ``bulk``: ``platform.submit_many("conveyor.demo.noop", [{"n": i} ...])``: payloads
  validated, rows and ``job.submitted`` events committed per batch (a synchronous commit
  each), each batch's messages published through one Redis pipeline after its commit.
  Checked afterwards: the ``demo`` queue holds N messages and Postgres N job rows.
* ``raw_kombu``: the same messages (Celery protocol 2 built by ``app.amqp.
  create_task_message``, same task name, ``conveyor_job_id`` header, same queue) sent with
  kombu's ``Producer.publish`` inside ``Producer.batch()``: one Redis pipeline per batch,
  no database. Checked: the queue holds N messages.
* ``procrastinate`` (when installed: ``pip install -e '.[bench]'``): ``batch_defer`` of N
  jobs (same batches) through its synchronous psycopg connector into its own database.

Each side gets one untimed warm-up batch first (connections, prepared statements), then its
queue or tables are emptied. Printed: ``bulk_submit_per_s``, ``raw_kombu_publish_per_s``,
``bulk_ratio_vs_raw_kombu``, ``procrastinate_batch_defer_per_s`` and a ``*_config`` line per
side; ``n``, ``batch_size`` and ``runs``.

Usage::

    .venv/bin/python -m bench.bulk              # N=100,000, 3 runs
    .venv/bin/python -m bench.bulk --smoke      # CI: N=2000, 1 run

Its Redis DB is 15 (flushed) and its Postgres databases ``conveyor_bench_bulk`` and
``conveyor_bench_bulk_procrastinate`` (dropped and created). Progress goes to stderr;
stdout carries only ``name=value`` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import celery
import kombu
from sqlalchemy import func, select

from bench.common import ROOT, BenchError, add_service_args, log, open_platform, prepare, recreate_database

if TYPE_CHECKING:
    from conveyor.platform import Platform

FULL_N = 100_000
SMOKE_N = 2000
BATCH_SIZE = 1000
WARMUP = 500
REDIS_DB = 15
DATABASE = "conveyor_bench_bulk"
PROCRASTINATE_DATABASE = "conveyor_bench_bulk_procrastinate"
STAGE = "conveyor.demo.noop"
QUEUE = "demo"

try:
    import procrastinate
except ImportError:  # pragma: no cover - depends on the extra
    procrastinate = None


def payloads(n: int, offset: int = 0) -> list[dict[str, int]]:
    """The benchmark's payloads: ``{"n": i}``."""
    return [{"n": offset + i} for i in range(n)]


def side_configs(batch_size: int) -> dict[str, str]:
    """What each side runs, as printed (``<side>_config=...``)."""
    configs = {
        "bulk": f"conveyor platform.submit_many({STAGE}), batch_size={batch_size}: validate, per "
        "batch one json_to_recordset INSERT (rows + job.submitted events) committed synchronously "
        "on a helper thread while the messages are built, sent once committed through one kombu "
        "publish batch (Redis pipeline)",
        "raw_kombu": f"kombu {kombu.__version__} Producer.publish in Producer.batch(), batches of "
        f"{batch_size}, celery {celery.__version__} protocol-2 messages from app.amqp."
        "create_task_message, same task name, headers and queue, no database",
    }
    if procrastinate is not None:
        from importlib.metadata import version

        configs["procrastinate"] = (
            f"procrastinate {version('procrastinate')} task.batch_defer, batches of {batch_size}, "
            "SyncPsycopgConnector, own database"
        )
    return configs


# -- the sides ------------------------------------------------------------------------------


def run_bulk(platform: Platform, n: int, batch_size: int, offset: int = 0) -> float:
    """``submit_many`` of ``n`` no-op jobs; seconds taken."""
    items = payloads(n, offset)
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        platform.submit_many(STAGE, items[i : i + batch_size], batch_size=batch_size)
    return time.perf_counter() - start


def raw_publish(platform: Platform, n: int, batch_size: int, offset: int = 0) -> float:
    """The same messages through a raw pipelined kombu publish, no database; seconds."""
    app = platform.app
    amqp = app.amqp
    items = payloads(n, offset)
    with kombu.Connection(platform.settings.redis_url) as conn:
        producer = conn.Producer()
        start = time.perf_counter()
        for i in range(0, n, batch_size):
            with producer.batch(max_size=batch_size + 1):
                for payload in items[i : i + batch_size]:
                    task_id = str(uuid.uuid4())
                    headers, properties, body, _ = amqp.create_task_message(
                        task_id, STAGE, (), payload, ignore_result=True, headers={"conveyor_job_id": task_id}
                    )
                    producer.publish(
                        body,
                        routing_key=QUEUE,
                        exchange="",
                        serializer="json",
                        headers={**headers, "conveyor_job_id": task_id},
                        declare=[],
                        retry=False,
                        **properties,
                    )
        return time.perf_counter() - start


def run_procrastinate(pg: str, n: int, batch_size: int) -> float:
    """``batch_defer`` of ``n`` jobs into Procrastinate's own database; seconds taken."""
    dsn = f"{pg.rstrip('/')}/{PROCRASTINATE_DATABASE}"
    recreate_database(pg, PROCRASTINATE_DATABASE)
    app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=dsn))

    @app.task(name="bench.procrastinate.noop", queue=QUEUE)  # type: ignore[misc]
    def noop(n: int) -> dict[str, int]:
        return {"n": n}

    with app.open():
        app.schema_manager.apply_schema()
        deferrer = noop.configure()
        deferrer.batch_defer(*payloads(min(WARMUP, n)))
        count(dsn, "DELETE FROM procrastinate_jobs")
        items = payloads(n)
        start = time.perf_counter()
        for i in range(0, n, batch_size):
            deferrer.batch_defer(*items[i : i + batch_size])
        seconds = time.perf_counter() - start
    expect("procrastinate: job rows", count(dsn, "SELECT count(*) FROM procrastinate_jobs"), n)
    return seconds


def count(dsn: str, sql: str) -> int:
    """Run ``sql`` on ``dsn``; its first column, or the rows it touched."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql)
        row = cur.fetchone() if cur.description else None
        return int(row[0]) if row else cur.rowcount


# -- checks ---------------------------------------------------------------------------------


def queued_messages(platform: Platform) -> int:
    """Messages waiting in the bench queue."""
    return int(platform.redis.llen(QUEUE))


def job_rows(platform: Platform) -> int:
    """Job rows in the bench database."""
    from conveyor.db.schema import jobs

    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())


def empty(platform: Platform) -> None:
    """Empty the queue and Conveyor's job tables (between sides)."""
    from conveyor.db.schema import job_events, jobs

    platform.redis.delete(QUEUE)
    with platform.engine.begin() as conn:
        conn.execute(jobs.delete())
        conn.execute(job_events.delete())


def expect(what: str, found: int, n: int) -> None:
    """Fail the benchmark unless ``found == n``."""
    if found != n:
        raise BenchError(f"{what}: found {found}, expected {n}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=FULL_N, help=f"jobs per side (default {FULL_N})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"default {BATCH_SIZE}")
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 1 run")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.runs = SMOKE_N, 1
    if min(args.n, args.batch_size, args.runs) < 1:
        parser.error("--n, --batch-size and --runs must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-bulk-")
    configs = side_configs(args.batch_size)
    figures: dict[str, float] = {}
    platform: Platform | None = None
    try:
        platform = open_platform()
        log(f"bulk: n={args.n} batch_size={args.batch_size} redis={services.redis_url}")
        log(f"  db={services.database_url} home={services.home}")
        for side, config in configs.items():
            log(f"  {side}: {config}")
        n, size = args.n, args.batch_size
        raw_publish(platform, min(WARMUP, n), size)
        run_bulk(platform, min(WARMUP, n), size)
        empty(platform)
        raw_runs: list[float] = []
        bulk_runs: list[float] = []
        for run in range(args.runs):
            seconds = raw_publish(platform, n, size)
            expect("raw_kombu: messages in the queue", queued_messages(platform), n)
            raw_runs.append(n / seconds)
            log(f"  run {run + 1}: raw_kombu {n} messages in {seconds:.2f}s ({n / seconds:.0f}/s)")
            empty(platform)

            seconds = run_bulk(platform, n, size)
            expect("bulk: messages in the queue", queued_messages(platform), n)
            expect("bulk: job rows", job_rows(platform), n)
            bulk_runs.append(n / seconds)
            log(f"  run {run + 1}: bulk {n} jobs in {seconds:.2f}s ({n / seconds:.0f}/s)")
            empty(platform)
        figures["raw_kombu_publish_per_s"] = statistics.median(raw_runs)
        figures["bulk_submit_per_s"] = statistics.median(bulk_runs)
        # Each run's own ratio (the two sides ran back to back), the median of them.
        figures["ratio"] = statistics.median(b / r for b, r in zip(bulk_runs, raw_runs, strict=True))

        if procrastinate is not None:
            seconds = run_procrastinate(args.pg, n, size)
            figures["procrastinate_batch_defer_per_s"] = n / seconds
            log(f"  procrastinate: {n} jobs in {seconds:.2f}s ({n / seconds:.0f}/s)")
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    finally:
        if platform is not None:
            platform.reset()
        recreate_database(args.pg, PROCRASTINATE_DATABASE, create=False)
        services.release()
    for side, config in configs.items():
        print(f'{side}_config="{config}"')
    if procrastinate is None:
        print("procrastinate_config=\"skipped: not installed (pip install -e '.[bench]')\"")
    print(f"bulk_submit_per_s={figures['bulk_submit_per_s']:.1f}")
    print(f"raw_kombu_publish_per_s={figures['raw_kombu_publish_per_s']:.1f}")
    print(f"bulk_ratio_vs_raw_kombu={figures['ratio']:.3f}")
    if "procrastinate_batch_defer_per_s" in figures:
        print(f"procrastinate_batch_defer_per_s={figures['procrastinate_batch_defer_per_s']:.1f}")
    print(f"n={args.n}")
    print(f"batch_size={args.batch_size}")
    print(f"runs={args.runs}")
    return 0


if __name__ == "__main__":
    # Procrastinate wants its app defined in an importable module, not ``__main__``.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.bulk import main as bench_main

    raise SystemExit(bench_main())
