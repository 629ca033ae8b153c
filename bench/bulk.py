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
  no database. Checked: the queue holds N messages. It lets Celery write the
  ``kwargsrepr`` header with ``saferepr`` (as any Celery publisher does); the bulk side
  writes the same text with ``repr`` where the two agree (:func:`conveyor.
  reprs.quick_kwargsrepr`), about 5 us per message less.
* ``procrastinate`` (when installed: ``pip install -e '.[bench]'``): ``batch_defer`` of N
  jobs (same batches) through its synchronous psycopg connector into its own database.

Each side gets one untimed warm-up batch first (connections, prepared statements), then its
queue or tables are emptied. Printed: ``bulk_submit_per_s``, ``raw_kombu_publish_per_s``,
``bulk_ratio_vs_raw_kombu``, ``procrastinate_batch_defer_per_s`` and a ``*_config`` line per
side; ``<side>_cpu_us_per_job`` with its split by process group (``_client``: this
process, all threads; ``_postgres``: the backends of the side's database; ``_redis``: the
server, shared: other clients count too), medians of the runs, from ``/proc``; ``n``,
``batch_size`` and ``runs``.

Usage::

    .venv/bin/python -m bench.bulk              # N=100,000, 3 runs
    .venv/bin/python -m bench.bulk --smoke      # CI: N=2000, 1 run

Its Redis DB is 15 (flushed) and its Postgres databases ``conveyor_bench_bulk`` and
``conveyor_bench_bulk_procrastinate`` (dropped and created). Progress goes to stderr;
stdout carries only ``name=value`` lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import celery
import kombu
from sqlalchemy import func, select

from bench.common import (
    ROOT,
    BenchError,
    CpuMeter,
    add_service_args,
    log,
    open_platform,
    prepare,
    recreate_database,
)

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
        "on a helper thread while the messages are built (kwargsrepr by repr where it equals "
        "saferepr), sent once committed through one kombu publish batch (Redis pipeline)",
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


def run_procrastinate(pg: str, n: int, batch_size: int, meter: Meter) -> tuple[float, dict[str, float]]:
    """``batch_defer`` of ``n`` jobs into Procrastinate's own database; seconds taken and
    CPU used."""
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

        def timed() -> float:
            start = time.perf_counter()
            for i in range(0, n, batch_size):
                deferrer.batch_defer(*items[i : i + batch_size])
            return time.perf_counter() - start

        seconds, used = meter.run(PROCRASTINATE_DATABASE, timed)
    expect("procrastinate: job rows", count(dsn, "SELECT count(*) FROM procrastinate_jobs"), n)
    return seconds, used


def count(dsn: str, sql: str) -> int:
    """Run ``sql`` on ``dsn``; its first column, or the rows it touched."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql)
        row = cur.fetchone() if cur.description else None
        return int(row[0]) if row else cur.rowcount


# -- CPU ------------------------------------------------------------------------------------

GROUPS = ("client", "postgres", "redis")


class Meter:
    """CPU per process group over one side's run: this process (the client, all its
    threads), the Postgres backends of the side's database and the Redis server."""

    def __init__(self, pg: str, redis_pid: int) -> None:
        import psycopg

        self.conn = psycopg.connect(f"{pg.rstrip('/')}/postgres", autocommit=True)
        self.redis_pid = redis_pid

    def backends(self, database: str) -> list[int]:
        """Pids of the backends connected to ``database`` (not this meter's own)."""
        rows = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,))
        return [int(r[0]) for r in rows]

    def run(self, database: str, fn: Callable[[], float]) -> tuple[float, dict[str, float]]:
        """``fn()``'s result and the CPU seconds each group used meanwhile."""
        meter = CpuMeter(
            {
                "client": lambda: [os.getpid()],
                "postgres": lambda: self.backends(database),
                "redis": lambda: [self.redis_pid],
            }
        )
        meter.start()
        try:
            result = fn()
        finally:
            used = meter.stop()
        return result, used

    def close(self) -> None:
        """Close the meter's connection."""
        self.conn.close()


def cpu_lines(side: str, runs: Sequence[dict[str, float]], n: int) -> list[str]:
    """``<side>_cpu_us_per_job`` (all groups) and one line per group, medians of the runs."""
    per_group = {g: statistics.median(r[g] for r in runs) * 1e6 / n for g in GROUPS}
    lines = [f"{side}_cpu_us_per_job={sum(per_group.values()):.1f}"]
    lines += [f"{side}_cpu_us_per_job_{g}={v:.1f}" for g, v in per_group.items()]
    return lines


# -- checks ---------------------------------------------------------------------------------


def queued_messages(platform: Platform) -> int:
    """Messages waiting in the bench queue."""
    return int(platform.redis.llen(QUEUE))


def job_rows(platform: Platform) -> int:
    """Job rows in the bench database."""
    from conveyor.store.db.schema import jobs

    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())


def empty(platform: Platform) -> None:
    """Empty the queue and Conveyor's job tables (between sides)."""
    from conveyor.store.db.schema import job_events, jobs

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
    cpu: dict[str, list[dict[str, float]]] = {side: [] for side in configs}
    platform: Platform | None = None
    meter = Meter(args.pg, int(services.redis.info("server")["process_id"]))
    try:
        platform = open_platform()
        log(f"bulk: n={args.n} batch_size={args.batch_size} runs={args.runs} redis={services.redis_url}")
        log(f"  db={services.database_url} home={services.home}")
        for side, config in configs.items():
            log(f"  {side}: {config}")
        n, size, bench = args.n, args.batch_size, platform
        raw_publish(bench, min(WARMUP, n), size)
        run_bulk(bench, min(WARMUP, n), size)
        empty(bench)
        raw_runs: list[float] = []
        bulk_runs: list[float] = []
        for run in range(args.runs):
            seconds, used = meter.run(args.database, lambda: raw_publish(bench, n, size))
            expect("raw_kombu: messages in the queue", queued_messages(bench), n)
            raw_runs.append(n / seconds)
            cpu["raw_kombu"].append(used)
            log(f"  run {run + 1}: raw_kombu {n} messages in {seconds:.2f}s ({n / seconds:.0f}/s)")
            empty(bench)

            seconds, used = meter.run(args.database, lambda: run_bulk(bench, n, size))
            expect("bulk: messages in the queue", queued_messages(bench), n)
            expect("bulk: job rows", job_rows(bench), n)
            bulk_runs.append(n / seconds)
            cpu["bulk"].append(used)
            log(f"  run {run + 1}: bulk {n} jobs in {seconds:.2f}s ({n / seconds:.0f}/s)")
            empty(bench)
        figures["raw_kombu_publish_per_s"] = statistics.median(raw_runs)
        figures["bulk_submit_per_s"] = statistics.median(bulk_runs)
        # Each run's own ratio (the two sides ran back to back), the median of them.
        figures["ratio"] = statistics.median(b / r for b, r in zip(bulk_runs, raw_runs, strict=True))

        if procrastinate is not None:
            seconds, used = run_procrastinate(args.pg, n, size, meter)
            figures["procrastinate_batch_defer_per_s"] = n / seconds
            cpu["procrastinate"].append(used)
            log(f"  procrastinate: {n} jobs in {seconds:.2f}s ({n / seconds:.0f}/s)")
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    finally:
        meter.close()
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
    for side, runs in cpu.items():
        if runs:
            print("\n".join(cpu_lines(side, runs, args.n)))
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
