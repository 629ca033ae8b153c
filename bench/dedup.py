"""Dedup costs and safety: the duplicate fast path, the new-submit overhead, a gated burst.

Three measurements against real Redis and Postgres (own Redis DB index, own database):

* **burst** (first, while the queue is still empty): ``--burst`` identical submits of
  ``conveyor.demo.effect`` (simple dedup on a fresh key, ``"bench:{note}"``) from
  ``--threads`` threads released together by a :class:`threading.Barrier`, while no worker
  runs, so the holder stays queued. Exactly one submit may create a job; all must return
  the same id. Then one worker starts, the holder runs, we wait 2 s for stragglers and
  count the ``demo_effects`` rows with that note: ``duplicates_executed = rows - 1``.
* **duplicate submit**: one client, sequential. The first
  ``submit("conveyor.demo.noop", {"n": 1}, dedup=Dedup(mode="simple", key="bench:{n}"))``
  creates the holder (no worker runs any more: it stays queued, i.e. non-terminal); every
  later identical submit is a duplicate answered by the Redis fast path (asserted:
  ``handle.deduplicated``). Each call is timed with :func:`time.perf_counter_ns`.
* **new submit**: the same policy with a distinct key per submit (``{"n": i}``), against
  a plain ``submit("conveyor.demo.noop", {"n": i})``. The two sides are interleaved in
  blocks of 100 so that table growth and background noise hit both alike.

Each latency phase has a warm-up (not recorded). Percentiles are nearest-rank.

Usage::

    .venv/bin/python bench/dedup.py             # 2000 samples per latency, burst of 500
    .venv/bin/python bench/dedup.py --smoke     # CI: 200 samples, burst of 50
    .venv/bin/python bench/dedup.py --profile /tmp/dup.prof   # cProfile the duplicate path

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs:
``dedup_submit_p50_ms``, ``dedup_submit_p99_ms``, ``new_submit_p99_ms_dedup_on``,
``new_submit_p99_ms_dedup_off``, ``duplicates_executed``, ``samples``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import ROOT, BenchError, BenchWorker, add_service_args, log, open_platform, prepare

if TYPE_CHECKING:
    from conveyor.client.handle import JobHandle
    from conveyor.platform import Platform

QUEUE = "demo"
NOOP = "conveyor.demo.noop"
EFFECT = "conveyor.demo.effect"
REDIS_DB = 14
DATABASE = "conveyor_bench_dedup"
STRAGGLER_WAIT = 2.0
BLOCK = 100  # interleaving block of the new-submit sides
NEW_KEY_BASE = 1_000_000  # distinct from the duplicate phase's n=1


def percentile_ms(samples_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of nanosecond samples, in milliseconds."""
    ordered = sorted(samples_ns)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1e6


def timed(fn: Callable[[], object]) -> int:
    """Nanoseconds one call of ``fn`` took."""
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


@dataclass
class DedupBench:
    """One benchmark invocation: the platform, its services and the options."""

    platform: Platform
    home: Path
    samples: int
    warmup: int
    burst: int
    threads: int
    worker: BenchWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)

    # -- workers ---------------------------------------------------------------------

    def start_worker(self) -> None:
        """Start one prefork worker on ``demo`` (2 slots) and wait until it answers a ping."""
        self.worker.start(
            self.platform.settings, self.platform.app, name="dedup", queues=[QUEUE], concurrency=2
        )

    def stop_worker(self) -> None:
        """Warm-stop the worker, if one runs."""
        self.worker.stop()

    # -- burst -----------------------------------------------------------------------

    def run_burst(self) -> int:
        """The gated burst; returns how many bodies ran beyond the one allowed."""
        from sqlalchemy import func, select

        from conveyor.dedup import Dedup
        from conveyor.store.db.schema import jobs
        from tasks.demo.models import effects

        if self.worker.proc is not None:
            raise BenchError("the burst needs every worker stopped")
        note = f"burst-{uuid.uuid4().hex[:12]}"
        policy = Dedup(mode="simple", key="bench:{note}")
        barrier = threading.Barrier(self.threads)
        share, extra = divmod(self.burst, self.threads)
        per_thread = [share + (i < extra) for i in range(self.threads)]
        handles: list[list[JobHandle]] = [[] for _ in range(self.threads)]
        errors: list[BaseException] = []

        def submitter(slot: int) -> None:
            try:
                barrier.wait(timeout=30)
                for _ in range(per_thread[slot]):
                    handles[slot].append(self.platform.submit(EFFECT, {"note": note}, dedup=policy))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=submitter, args=(i,)) for i in range(self.threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise BenchError(f"{len(errors)} burst submits failed, first: {errors[0]!r}")
        flat = [h for hs in handles for h in hs]
        ids = {h.id for h in flat}
        created = [h for h in flat if not h.deduplicated]
        log(
            f"burst: {len(flat)} submits from {self.threads} threads in {elapsed:.2f}s, "
            f"{len(created)} created, {len(ids)} distinct job id(s)"
        )
        if len(flat) != self.burst or len(created) != 1 or len(ids) != 1:
            raise BenchError(f"burst: expected 1 job for {self.burst} submits, got {len(created)} / {ids}")
        holder = created[0]
        self.start_worker()
        try:
            status = holder.wait(60)
            time.sleep(STRAGGLER_WAIT)
        finally:
            self.stop_worker()
        count_rows = select(func.count()).select_from(effects).where(effects.c.note == note)
        count_jobs = select(func.count()).select_from(jobs).where(jobs.c.stage == EFFECT)
        with self.platform.engine.connect() as conn:
            rows = int(conn.execute(count_rows).scalar_one())
            job_rows = int(conn.execute(count_jobs).scalar_one())
        log(f"burst: holder {status}, {rows} effect row(s), {job_rows} {EFFECT} job row(s)")
        if status != "succeeded" or rows < 1:
            raise BenchError(f"burst holder ended {status} with {rows} effect rows")
        return rows - 1

    # -- latency ---------------------------------------------------------------------

    def run_duplicates(self, profile: str | None) -> list[int]:
        """Sequential duplicate submits answered by the fast path; nanoseconds each."""
        from conveyor.dedup import Dedup

        policy = Dedup(mode="simple", key="bench:{n}")
        submit = self.platform.submit
        first = submit(NOOP, {"n": 1}, dedup=policy)
        if first.deduplicated:
            raise BenchError("the duplicate phase's first submit was itself a duplicate")

        def one() -> None:
            handle = submit(NOOP, {"n": 1}, dedup=policy)
            if not handle.deduplicated or handle.id != first.id:
                raise BenchError(f"submit returned {handle!r}, expected a duplicate of {first.id}")

        for _ in range(self.warmup):
            one()
        out = [timed(one) for _ in range(self.samples)]
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(self.samples):
                one()
            profiler.disable()
            profiler.dump_stats(profile)
            log(f"duplicate path profile ({self.samples} calls) written to {profile}")
        return out

    def run_new(self) -> tuple[list[int], list[int]]:
        """New submits with dedup on (distinct keys) and off, interleaved; nanoseconds each."""
        from conveyor.dedup import Dedup

        policy = Dedup(mode="simple", key="bench:{n}")
        submit = self.platform.submit
        counter = iter(range(NEW_KEY_BASE, sys.maxsize))

        def on() -> None:
            if submit(NOOP, {"n": next(counter)}, dedup=policy).deduplicated:
                raise BenchError("a submit with a fresh key was deduplicated")

        def off() -> None:
            if submit(NOOP, {"n": next(counter)}).deduplicated:
                raise BenchError("a plain submit was deduplicated")

        for _ in range(self.warmup):
            on()
            off()
        on_ns: list[int] = []
        off_ns: list[int] = []
        while len(on_ns) < self.samples:
            block = min(BLOCK, self.samples - len(on_ns))
            on_ns.extend(timed(on) for _ in range(block))
            off_ns.extend(timed(off) for _ in range(block))
        return on_ns, off_ns


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=2000, help="timed submits per latency (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed submits first (default 200)")
    parser.add_argument("--burst", type=int, default=500, help="identical submits in the burst (default 500)")
    parser.add_argument("--threads", type=int, default=10, help="burst threads (default 10)")
    parser.add_argument("--smoke", action="store_true", help="CI: 200 samples, 50 warm-up, burst of 50")
    parser.add_argument("--profile", default=None, help="also cProfile the duplicate path into this file")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples, args.warmup, args.burst = 200, 50, 50
    if args.samples < 1 or args.warmup < 0 or args.threads < 1 or args.burst < args.threads:
        parser.error("--samples and --threads must be positive, --burst at least --threads")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-dedup-")
    redis_url, database_url, home = services.redis_url, services.database_url, services.home
    bench: DedupBench | None = None
    try:
        platform = open_platform()
        bench = DedupBench(
            platform=platform,
            home=home,
            samples=args.samples,
            warmup=args.warmup,
            burst=args.burst,
            threads=args.threads,
        )
        log(
            f"dedup: samples={args.samples} warmup={args.warmup} burst={args.burst} "
            f"threads={args.threads} redis={redis_url} db={database_url} home={home}"
        )
        # The burst runs first: its worker must not find thousands of noop messages queued.
        executed = bench.run_burst()
        dup = bench.run_duplicates(args.profile)
        log(f"duplicate submit: p50 {percentile_ms(dup, 0.5):.3f} ms, p99 {percentile_ms(dup, 0.99):.3f} ms")
        new_on, new_off = bench.run_new()
        log(
            f"new submit p99: dedup on {percentile_ms(new_on, 0.99):.3f} ms, "
            f"off {percentile_ms(new_off, 0.99):.3f} ms"
        )
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            bench.stop_worker()
            bench.platform.reset()
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    print(f"dedup_submit_p50_ms={percentile_ms(dup, 0.5):.3f}")
    print(f"dedup_submit_p99_ms={percentile_ms(dup, 0.99):.3f}")
    print(f"new_submit_p99_ms_dedup_on={percentile_ms(new_on, 0.99):.3f}")
    print(f"new_submit_p99_ms_dedup_off={percentile_ms(new_off, 0.99):.3f}")
    print(f"duplicates_executed={executed}")
    print(f"samples={args.samples}")
    return 0 if executed == 0 else 1


if __name__ == "__main__":
    # Run as ``python bench/dedup.py`` or ``python -m bench.dedup``: the project root must be
    # importable (config/, tasks/), as it is for the worker through PYTHONPATH.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
