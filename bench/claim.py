"""The claim alone: the durable claim function against the same claim committed async.

Runs against the shared Postgres only (no Redis, no worker), in a scratch database that is
created, migrated and dropped. Two configurations of ``conveyor_claim``, the one
statement the runner's claim runs (:meth:`conveyor.store.db.lane.Lane.claim`):

* **durable**: the function exactly as migration 0007 defines it. The claim's commit
  waits for its WAL flush with the server's ``synchronous_commit`` and ``fsync`` (logged
  and printed as ``server_*``; the defaults are ``on``), so a Postgres crash cannot lose
  a claim and reissue its attempt number (the fencing token).
* **async**: the same body with ``PERFORM set_config('synchronous_commit', 'off', true)``
  first, as migrations 0004-0006 had it: the commit returns before its WAL is flushed,
  and a crash within the WAL writer's window loses the claim.

Per claim: insert a queued job (an ordinary synchronous transaction, not timed), then time
``Lane.claim`` (one autocommit statement), as the runner does, with
:func:`time.perf_counter_ns`. One client, sequential: each commit pays its own flush, with
no group commit to share it, so this is the durable claim's worst case. The sides are
interleaved in blocks of 100 claims (the function is redefined between blocks, outside
the timing) after a warm-up of each side (not recorded). ``claims_per_s`` is claims
divided by the time spent inside ``Lane.claim``; percentiles are nearest-rank.

Usage::

    .venv/bin/python bench/claim.py             # 2000 claims per side
    .venv/bin/python bench/claim.py --smoke     # CI: 100 claims per side
    .venv/bin/python bench/claim.py --n 5000

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs:
``durable_claims_per_s``, ``async_claims_per_s``, ``async_over_durable``,
``durable_claim_p50_ms``, ``durable_claim_p99_ms``, ``async_claim_p50_ms``,
``async_claim_p99_ms``, ``server_fsync``, ``server_synchronous_commit``, ``n``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.common import DEFAULT_PG, ROOT, BenchError, log, recreate_database

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from conveyor.store.db.lane import Lane
    from conveyor.store.jobs import JobStore

DATABASE = "conveyor_bench_claim"
SMOKE_N = 100
BLOCK = 100
WARMUP = 50
SMOKE_WARMUP = 10
ASYNC_LINE = "  PERFORM set_config('synchronous_commit', 'off', true);\n"
SIDES = ("durable", "async")


def claim_functions() -> dict[str, str]:
    """``CREATE OR REPLACE FUNCTION conveyor_claim`` for each side, from migration 0007."""
    mig = importlib.import_module("conveyor.store.migrations.versions.0007_attempt_accounting")
    durable = str(mig.CLAIM)
    if "synchronous_commit" in durable:
        raise BenchError("migration 0007's claim sets synchronous_commit itself: the labels would lie")
    if durable.count("BEGIN\n") != 1:
        raise BenchError("cannot find the claim function's BEGIN to derive the async variant")
    return {"durable": durable, "async": durable.replace("BEGIN\n", "BEGIN\n" + ASYNC_LINE)}


def percentile_ms(samples_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of nanosecond samples, in milliseconds."""
    ordered = sorted(samples_ns)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1e6


def claim_block(engine: Engine, lane: Lane, store: JobStore, count: int) -> list[int]:
    """``count`` times: insert a queued job, then time its ``Lane.claim`` (nanoseconds)."""
    from conveyor.store.jobs import NewJob
    from conveyor.worker.runner import lease_owner

    owner = lease_owner()
    samples: list[int] = []
    for i in range(count):
        with engine.begin() as conn:
            job_id, _ = store.insert(
                conn, NewJob(stage="conveyor.demo.noop", queue="demo", payload={"n": i}, max_attempts=3)
            )
        task_id = str(uuid.uuid4())
        start = time.perf_counter_ns()
        row = lane.claim(job_id, owner=owner, task_id=task_id)
        samples.append(time.perf_counter_ns() - start)
        if row is None or row["attempts"] != 1:
            raise BenchError(f"claim of job {job_id} did not win attempt 1: {row!r}")
    return samples


def run(engine: Engine, n: int, warmup: int) -> dict[str, list[int]]:
    """Warm up both sides, then interleave blocks until each side has ``n`` samples."""
    from conveyor.store.db.lane import Lane
    from conveyor.store.db.namespace import SCHEMA
    from conveyor.store.jobs import JobStore

    functions = claim_functions()
    lane = Lane(engine, SCHEMA)
    store = JobStore(lease_timeout=60)
    samples: dict[str, list[int]] = {side: [] for side in SIDES}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as claims:

        def use(side: str) -> None:
            claims.exec_driver_sql(functions[side])

        for side in SIDES:
            use(side)
            claim_block(engine, lane, store, warmup)
        while len(samples["async"]) < n:
            for side in SIDES:
                use(side)
                samples[side] += claim_block(engine, lane, store, min(BLOCK, n - len(samples[side])))
    return samples


def server_setting(engine: Engine, name: str) -> str:
    """One server setting (``SHOW``), as text."""
    with engine.connect() as conn:
        return str(conn.exec_driver_sql(f"SHOW {name}").scalar_one())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=2000, help="timed claims per side (default 2000)")
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--database", default=DATABASE, help="Postgres database (dropped and created)")
    args = parser.parse_args(argv)
    args.warmup = WARMUP
    if args.smoke:
        args.n, args.warmup = SMOKE_N, SMOKE_WARMUP
    if args.n < 1:
        parser.error("--n must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    from conveyor.store.db.engine import make_engine
    from conveyor.store.db.migrate import upgrade

    args = parse_args(argv)
    database_url = f"{args.pg.rstrip('/')}/{args.database}"
    recreate_database(args.pg, args.database)
    # One connection redefines the function, the lane keeps one, inserts take a third.
    engine = make_engine(database_url, pool_size=3)
    try:
        upgrade(engine)
        fsync = server_setting(engine, "fsync")
        sync_commit = server_setting(engine, "synchronous_commit")
        log(
            f"claim: n={args.n} per side, warm-up {args.warmup}, blocks of {BLOCK}, db={database_url}, "
            f"server fsync={fsync} synchronous_commit={sync_commit} "
            f"wal_sync_method={server_setting(engine, 'wal_sync_method')}"
        )
        samples = run(engine, args.n, args.warmup)
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    finally:
        engine.dispose()
        recreate_database(args.pg, args.database, create=False)
    rate = {side: len(s) / (sum(s) / 1e9) for side, s in samples.items()}
    for side in SIDES:
        log(
            f"{side:7s}: {rate[side]:8.1f} claims/s, p50 {percentile_ms(samples[side], 0.5):.3f} ms, "
            f"p99 {percentile_ms(samples[side], 0.99):.3f} ms"
        )
    print(f"durable_claims_per_s={rate['durable']:.1f}")
    print(f"async_claims_per_s={rate['async']:.1f}")
    print(f"async_over_durable={rate['async'] / rate['durable']:.3f}")
    for side in SIDES:
        print(f"{side}_claim_p50_ms={percentile_ms(samples[side], 0.5):.3f}")
        print(f"{side}_claim_p99_ms={percentile_ms(samples[side], 0.99):.3f}")
    print(f"server_fsync={fsync}")
    print(f"server_synchronous_commit={sync_commit}")
    print(f"n={args.n}")
    return 0


if __name__ == "__main__":
    # Run as ``python bench/claim.py`` or ``python -m bench.claim``: the project root must be
    # importable, as for the other benchmarks.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
