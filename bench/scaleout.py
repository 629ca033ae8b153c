"""Scale-out: Conveyor's drain with 1, 2 and 3 worker hosts, what each job costs the shared
services, and the ceiling that projects.

Hosts come from the multi-host test harness (``tests/multihost/harness.py``, one copy):
network and PID namespaces on a Linux bridge, each with its own hostname, running one
prefork ``conveyor worker``; a private Redis and a private Postgres listen on the bridge's
address (so this needs root). Postgres runs with ``fsync=on`` here (the test servers turn
it off), otherwise with the harness's settings. Every timer is Conveyor's default.

For k = 1, 2, 3 hosts (a host is added between steps): every worker idles on an empty
queue; N ``conveyor.demo.noop`` jobs are submitted (``submit_many``); the services' idle
rates are measured for a moment; then every worker is told to ``add_consumer`` the full
queue, and the drain is timed until every job is terminal (a ``COUNT`` every 50 ms), then
the workers ``cancel_consumer`` it again. Over the drain window, per job:

* ``pg_commits``: ``pg_stat_database.xact_commit`` delta of the database, read 10.5 s
  after the window (an idle backend reports its statistics within 10 s; ``--smoke`` waits
  1.1 s, so its figure lags and means little);
* ``pg_write_commits``: transaction ids assigned (``pg_current_snapshot()``'s xmax delta):
  the transactions that wrote, each of which waits for a WAL flush at commit (counted at
  once, no lag); the fsync bound uses this;
* ``wal_bytes``: ``pg_current_wal_lsn()`` delta;
* ``pg_cpu_us``: utime + stime of the whole Postgres cluster (postmaster and children,
  from ``/proc``, sampled every 0.2 s);
* ``redis_cmds``: the ``calls`` of ``INFO commandstats``, summed, delta;
* ``redis_cpu_us``: ``INFO``'s ``used_cpu_sys + used_cpu_user`` delta.

The idle rate of each (relay passes, heartbeats, the bench's own polling) times the window
is taken out first. The ceiling is projected from the largest step:

* Postgres: min(0.7 x cores / Postgres CPU-seconds per job, ``pg_test_fsync``'s fdatasync
  ops/s / write commits per job) (a read-only commit flushes nothing; group commit and
  ``synchronous_commit=off`` commits only help);
* Redis: 0.7 x one core / Redis CPU-seconds per job (Redis runs commands on one thread);

and ``ceiling_bound`` says which applies. Usage::

    sudo .venv/bin/python -m bench.scaleout --smoke     # CI: small N (< 60 s)
    sudo .venv/bin/python -m bench.scaleout             # N=3000 per step

Progress goes to stderr; stdout carries only ``name=value`` lines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import CpuMeter, log, process_tree
from bench.throughput import fsync_rate

SMOKE_N = 60
FULL_N = 3000
CONCURRENCY = 4
HOST_COUNTS = (1, 2, 3)
QUEUE = "demo"
STAGE = "conveyor.demo.noop"
IDLE_WINDOW = 1.0
POLL = 0.05
SMOKE_SETTLE = 1.1
FULL_SETTLE = 10.5
HEADROOM = 0.7  # of a core: what a server can sustain without queueing blowing up


@dataclass
class Counters:
    """One reading of the services' counters."""

    commits: int
    xids: int  # the next transaction id: write transactions are the ones that take one
    wal: int  # bytes since 0/0
    redis_cmds: int
    redis_cpu: float  # seconds


@dataclass
class Step:
    """One drain with ``hosts`` hosts; every cost is per job."""

    hosts: int
    n: int
    seconds: float
    pg_commits: float
    pg_writes: float
    wal_bytes: float
    pg_cpu: float  # seconds
    redis_cmds: float
    redis_cpu: float  # seconds

    @property
    def per_s(self) -> float:
        return self.n / self.seconds


class Monitor:
    """Reads Postgres's and Redis's counters on one autocommit connection, and counts its
    own statements and commands so they can be taken out."""

    def __init__(self, database_url: str, redis: Any, datadir: Path, settle: float) -> None:
        import psycopg

        self.conn = psycopg.connect(database_url, autocommit=True)
        self.database = str(self.conn.execute("SELECT current_database()").fetchone()[0])  # type: ignore[index]
        self.redis = redis
        self.postmaster = int((datadir / "postmaster.pid").read_text().split()[0])
        self.own_commits = 0
        self.own_cmds = 0
        self.settle_seconds = settle

    def read(self) -> Counters:
        """Every counter, now (one statement, one INFO)."""
        row = self.conn.execute(
            "SELECT xact_commit, pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') FROM pg_stat_database WHERE datname = %s",
            (self.database,),
        ).fetchone()
        assert row is not None
        info = self.redis.info("all")
        cmds = sum(int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_"))
        self.own_commits += 1
        self.own_cmds += 1
        cpu = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return Counters(int(row[0]), int(row[1]), int(row[2]), cmds, cpu)

    def unfinished(self) -> int:
        """Jobs not yet terminal."""
        self.own_commits += 1
        row = self.conn.execute(
            "SELECT count(*) FROM conveyor.jobs WHERE status NOT IN "
            "('succeeded', 'dead', 'cancelled', 'expired', 'skipped')"
        ).fetchone()
        return int(row[0]) if row else 0

    def meter(self) -> CpuMeter:
        """CPU of the whole Postgres cluster."""
        return CpuMeter({"postgres": lambda: process_tree(self.postmaster)})

    def settle(self) -> Counters:
        """Counters once the backends flushed their statistics: a busy backend flushes at
        most once a second, an idle one within 10 s (``PGSTAT_IDLE_INTERVAL``)."""
        time.sleep(self.settle_seconds)
        return self.read()


@dataclass
class Rates:
    """Per second, or per job, of each counter."""

    commits: float
    writes: float
    wal: float
    pg_cpu: float
    redis_cmds: float
    redis_cpu: float


def window(monitor: Monitor, meter: CpuMeter, a: Counters, own_a: tuple[int, int], b: Counters) -> Rates:
    """What the services did between readings ``a`` and ``b``, the monitor's own
    statements and commands taken out (each reading's own is counted in the next)."""
    own_commits, own_cmds = monitor.own_commits - own_a[0], monitor.own_cmds - own_a[1]
    return Rates(
        commits=b.commits - a.commits - own_commits,
        writes=b.xids - a.xids,
        wal=b.wal - a.wal,
        pg_cpu=meter.stop()["postgres"],
        redis_cmds=b.redis_cmds - a.redis_cmds - own_cmds,
        redis_cpu=b.redis_cpu - a.redis_cpu,
    )


def measure(monitor: Monitor, app: Any, platform: Any, workers: list[str], hosts: int, n: int) -> Step:
    """Submit ``n`` jobs with every worker idle, then drain them with all of ``workers``."""
    platform.submit_many(STAGE, [{"n": i} for i in range(n)])
    # The idle rates: relay passes, heartbeats, liveness keys.
    a = monitor.settle()
    own_a, meter, t_a = (monitor.own_commits, monitor.own_cmds), monitor.meter(), time.perf_counter()
    meter.start()
    time.sleep(IDLE_WINDOW)
    b = monitor.settle()
    idle = window(monitor, meter, a, own_a, b)
    idle_seconds = time.perf_counter() - t_a

    own_a, meter = (monitor.own_commits, monitor.own_cmds), monitor.meter()
    meter.start()
    before = monitor.read()
    own_a = (monitor.own_commits, monitor.own_cmds)
    start = time.perf_counter()
    reply = app.control.add_consumer(QUEUE, destination=workers, reply=True, timeout=10)
    if len(reply or []) != len(workers):
        raise RuntimeError(f"add_consumer confirmed by {len(reply or [])} of {len(workers)} workers")
    while monitor.unfinished():
        if time.perf_counter() - start > max(120.0, n * 0.2):
            raise RuntimeError(f"{monitor.unfinished()} jobs unfinished")
        time.sleep(POLL)
    seconds = time.perf_counter() - start
    app.control.cancel_consumer(QUEUE, destination=workers, reply=True, timeout=10)
    after = monitor.settle()
    busy = window(monitor, meter, before, own_a, after)
    span = time.perf_counter() - start
    rest = span / idle_seconds  # the idle rates' share of the window

    def per_job(total: float, idle_total: float) -> float:
        return max(0.0, total - idle_total * rest) / n

    return Step(
        hosts,
        n,
        seconds,
        pg_commits=per_job(busy.commits, idle.commits),
        pg_writes=per_job(busy.writes, idle.writes),
        wal_bytes=per_job(busy.wal, idle.wal),
        pg_cpu=per_job(busy.pg_cpu, idle.pg_cpu),
        redis_cmds=per_job(busy.redis_cmds, idle.redis_cmds),
        redis_cpu=per_job(busy.redis_cpu, idle.redis_cpu),
    )


def ceiling(step: Step, cores: int, fsync: float | None) -> dict[str, str]:
    """The projected ceiling (jobs/s) from one step's costs, with its arithmetic."""
    out: dict[str, str] = {}
    pg_cpu = HEADROOM * cores / step.pg_cpu if step.pg_cpu else float("inf")
    pg_fsync = fsync / step.pg_writes if fsync and step.pg_writes else float("inf")
    pg = min(pg_cpu, pg_fsync)
    redis = HEADROOM / step.redis_cpu if step.redis_cpu else float("inf")
    bound = "redis cpu" if redis < pg else ("postgres fsync" if pg_fsync < pg_cpu else "postgres cpu")
    fsync_text = f"{fsync:.0f}" if fsync else "n/a"
    out["ceiling_postgres_cpu_jobs_per_s"] = f"{pg_cpu:.0f}"
    out["ceiling_postgres_fsync_jobs_per_s"] = f"{pg_fsync:.0f}"
    out["ceiling_postgres_jobs_per_s"] = f"{pg:.0f}"
    out["ceiling_redis_jobs_per_s"] = f"{redis:.0f}"
    out["ceiling_jobs_per_s"] = f"{min(pg, redis):.0f}"
    out["ceiling_bound"] = f'"{bound}"'
    out["ceiling_arithmetic"] = (
        f'"postgres = min({HEADROOM} x {cores} cores / {step.pg_cpu:.6f} cpu-s per job, '
        f"{fsync_text} fdatasync/s / {step.pg_writes:.2f} write commits per job) = min({pg_cpu:.0f}, "
        f"{pg_fsync:.0f}) = {pg:.0f} jobs/s; redis = {HEADROOM} x 1 core / {step.redis_cpu:.6f} "
        f'cpu-s per job = {redis:.0f} jobs/s; ceiling = {min(pg, redis):.0f} jobs/s ({bound})"'
    )
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=FULL_N, help=f"jobs per step (default {FULL_N})")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="pool slots per host")
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 2 slots per host")
    parser.add_argument(
        "--broker",
        choices=["redis", "rabbitmq"],
        default="redis",
        help="Celery's broker: the private Redis, or a private RabbitMQ node on the bridge",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.concurrency = SMOKE_N, 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    from tests.multihost.harness import can_run

    problem = can_run()
    if problem:
        log(f"scaleout: {problem}")
        return 2
    home = Path(tempfile.mkdtemp(prefix="conveyor-scaleout-"))
    # Settings are read when config.celery_app is imported: the services come first.
    os.environ["CONVEYOR_HOME"] = str(home)
    fsync: list[float | None] = []
    # pg_test_fsync takes ~16 s: in smoke mode it runs while the hosts boot (nothing is
    # measured then); otherwise alone, before them.
    prober = threading.Thread(target=lambda: fsync.append(fsync_rate()), daemon=True)
    prober.start()
    if not args.smoke:
        prober.join()
    from conveyor.settings import ConveyorSettings
    from tests.multihost.harness import cluster

    steps: list[Step] = []
    cores = os.cpu_count() or 1
    rabbitmq = args.broker == "rabbitmq"
    with cluster(ConveyorSettings(home=home), home, postgres_options={"fsync": "on"}, rabbitmq=rabbitmq) as c:
        os.environ["CONVEYOR_REDIS_URL"] = c.services.redis_url
        os.environ["CONVEYOR_DATABASE_URL"] = c.services.database_url
        if c.services.broker_url is not None:
            os.environ["CONVEYOR_BROKER_URL"] = c.services.broker_url
        from bench.common import open_platform
        from config.queues import DEFAULT_QUEUE

        platform = open_platform()
        log(
            f"scaleout: n={args.n} per step, {args.concurrency} slots per host, {cores} cores, "
            f"redis={c.services.redis_url} db={c.services.database_url} logs={home}"
        )
        services = c.services
        settle = SMOKE_SETTLE if args.smoke else FULL_SETTLE
        monitor = Monitor(services.database_url, services.redis.client(), services.postgres.datadir, settle)
        try:
            workers: list[str] = []
            for k in HOST_COUNTS:
                host = c.add_host(concurrency=args.concurrency, queues=[DEFAULT_QUEUE])
                workers.append(f"w0@{host.name}")
                prober.join()
                step = measure(monitor, platform.app, platform, workers, k, args.n)
                log(f"  {k} host(s): {step.per_s:.0f} jobs/s")
                steps.append(step)
        finally:
            monitor.conn.close()
            platform.reset()
            platform.engine.dispose()
    shutil.rmtree(home, ignore_errors=True)
    print(
        f'scaleout_config="conveyor worker -P prefork -c {args.concurrency} per host (network+PID '
        f"namespace), default timers, {STAGE}; private redis-server and postgres 15 (fsync=on)"
        f"{' and rabbitmq 3.10 (the broker, quorum queues)' if rabbitmq else ' (Redis the broker)'} "
        f'on the bridge, {cores} cores shared by all"'
    )
    for step in steps:
        k = step.hosts
        print(f"hosts_{k}_drain_per_s={step.per_s:.1f}")
        print(f"hosts_{k}_pg_commits_per_job={step.pg_commits:.2f}")
        print(f"hosts_{k}_pg_write_commits_per_job={step.pg_writes:.2f}")
        print(f"hosts_{k}_wal_bytes_per_job={step.wal_bytes:.0f}")
        print(f"hosts_{k}_pg_cpu_us_per_job={step.pg_cpu * 1e6:.0f}")
        print(f"hosts_{k}_redis_cmds_per_job={step.redis_cmds:.1f}")
        print(f"hosts_{k}_redis_cpu_us_per_job={step.redis_cpu * 1e6:.0f}")
    rate = fsync[0] if fsync else None
    print(f"cores={cores}")
    print(
        f"pg_test_fsync_fdatasync_ops_per_s={rate:.0f}" if rate else "pg_test_fsync_fdatasync_ops_per_s=n/a"
    )
    for name, value in ceiling(steps[-1], cores, rate).items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
