"""Preemption latency: from a high-priority submit to its body starting, lease held by a sync.

One real prefork worker (2 slots, prefetch disabled by the platform's Celery config, queues
``priority`` and ``demo``: ``conveyor.demo.write`` is routed to ``priority``), started with
``CONVEYOR_PREEMPT_GRACE=2``. Per run, with a fresh user key:

1. submit a holder ``conveyor.demo.sync`` (preemptable, lease ``user:{user}``, priority 0)
   with ``records=100000, every=10, per_record=0.005``: it checkpoints every 10 records,
   i.e. every ~50 ms of work;
2. wait until it runs: its marker row ``"{note}:start:1"`` appears in ``demo_effects``
   (the database is polled every 5 ms);
3. optionally (``--phase MS``) sleep a random time in ``[0, MS)`` ms, then
   ``t0 = time.monotonic()``; submit the preemptor ``conveyor.demo.write`` (priority 10,
   same lease key). The other slot is free, so its message is taken at once; it asks the
   holder to yield and waits in its slot (``BLPOP`` on the key's wake list) until the
   holder checkpoints, raises ``Preempted`` and releases the lease;
4. the preemptor's first action is a committed marker ``"{note}:start"``; the bench polls
   for it every 2 ms and takes ``time.monotonic()`` when it sees it. The figure therefore
   includes the submit call itself and up to one poll interval plus one query (~2.5 ms);
5. cancel the holder (requeued by the preemption, or already running again) and wait until
   both jobs are terminal before the next run (a cancel that lost a race with the holder's
   next claim is repeated and reported on stderr).

Without ``--phase`` (the default, the procedure as specified) the preemptor is submitted
a few milliseconds after the holder's first checkpoint, so every run meets the holder at
the same point of its ~55 ms checkpoint cycle: the figure is phase-locked (the holder
notices the stop at its second checkpoint, 55-60 ms after the submit). ``--phase 55`` spreads
the submit uniformly over one checkpoint period, which is what an arbitrary submit sees.

A second, poll-free figure is logged on stderr per run from the database clock
(``clock_timestamp()`` on the same host): the preemptor row's ``created_at`` to its marker's
``created_at``, with a breakdown (claim, holder noticed the stop = its cleanup marker,
holder released = its ``job.preempted`` event, preemptor body start).

Usage::

    .venv/bin/python bench/preemption.py             # 50 runs (plus 2 warm-up runs)
    .venv/bin/python bench/preemption.py --smoke     # CI: 3 runs (plus 1 warm-up run)
    .venv/bin/python bench/preemption.py --phase 55  # submit at a random checkpoint phase

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs:
``preemption_p50_ms``, ``preemption_p95_ms``, ``runs``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import random
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import ROOT, BenchError, BenchWorker, add_service_args, log, open_platform, prepare

if TYPE_CHECKING:
    from conveyor.platform import Platform

QUEUES = ["priority", "demo"]
SYNC = "conveyor.demo.sync"
WRITE = "conveyor.demo.write"
REDIS_DB = 15
DATABASE = "conveyor_bench_preempt"
HOLDER_POLL = 0.005
MARKER_POLL = 0.002
START_TIMEOUT = 60.0
PREEMPT_TIMEOUT = 60.0
CANCEL_WAIT = 5.0  # a cancelled holder stops at its next checkpoint (~55 ms) or at once if queued
HOLDER_TIMEOUT = 30.0
SYNC_PAYLOAD = {"records": 100_000, "every": 10, "per_record": 0.005}
WORKER_ENV = {"CONVEYOR_PREEMPT_GRACE": "2"}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@dataclass
class Run:
    """One measured preemption."""

    latency_ms: float  # bench clock: submit call to marker seen
    db_ms: float  # database clock: preemptor row created to its marker created
    claim_ms: float  # database clock: preemptor row created to claimed (started_at)
    noticed_ms: float | None  # database clock: preemptor row created to the holder's cleanup marker
    released_ms: float | None  # database clock: preemptor row created to the holder's job.preempted
    submit_ms: float  # bench clock: the submit call alone
    holder_status: str


@dataclass
class PreemptionBench:
    """One benchmark invocation: the platform, its worker and the options."""

    platform: Platform
    home: Path
    phase_ms: float = 0.0
    recancels: int = 0
    escalations: int = 0
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    worker: BenchWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)

    # -- worker ----------------------------------------------------------------------

    def start_worker(self) -> None:
        """Start the 2-slot prefork worker and wait until it answers a ping."""
        self.worker.start(
            self.platform.settings,
            self.platform.app,
            name="preempt",
            queues=QUEUES,
            concurrency=2,
            extra_env=WORKER_ENV,
        )

    def check_worker(self) -> None:
        """Fail fast if the worker died."""
        self.worker.check()

    def stop_worker(self) -> None:
        """Warm-stop the worker, if one runs."""
        self.worker.stop()

    # -- database probes -------------------------------------------------------------

    def marker_at(self, note: str) -> dt.datetime | None:
        """``created_at`` of the ``demo_effects`` row with ``note``, if it exists."""
        from sqlalchemy import select

        from tasks.demo.models import effects

        with self.platform.engine.connect() as conn:
            return conn.execute(
                select(effects.c.created_at).where(effects.c.note == note).limit(1)
            ).scalar_one_or_none()

    def wait_marker(self, note: str, interval: float, timeout: float) -> dt.datetime:
        """Poll for the marker ``note`` every ``interval`` seconds; its ``created_at``."""
        deadline = time.monotonic() + timeout
        while True:
            at = self.marker_at(note)
            if at is not None:
                return at
            if time.monotonic() > deadline:
                self.check_worker()
                raise BenchError(f"marker {note!r} did not appear within {timeout:.0f}s")
            time.sleep(interval)

    def event_at(self, job_id: str, topic: str) -> dt.datetime | None:
        """``created_at`` of the first event ``topic`` of ``job_id``."""
        from sqlalchemy import select

        from conveyor.store.db.schema import job_events

        with self.platform.engine.connect() as conn:
            return conn.execute(
                select(job_events.c.created_at)
                .where(job_events.c.job_id == job_id, job_events.c.topic == topic)
                .order_by(job_events.c.id)
                .limit(1)
            ).scalar_one_or_none()

    def stop_holder(self, job_id: str, index: int) -> tuple[str, str]:
        """Cancel the holder and wait until it is terminal; (what cancel() said, final status).

        ``Platform.cancel`` reads the row unlocked and then runs a conditional update; when a
        concurrent transition wins (the preempted holder's requeue, or its next claim) the
        update matches nothing, nothing is recorded, and it still returns ``running``. A
        holder still running after :data:`CANCEL_WAIT` is therefore cancelled again (counted
        in :attr:`recancels` and logged).
        """
        handle = self.platform.job(job_id)
        deadline = time.monotonic() + HOLDER_TIMEOUT
        first: str | None = None
        while True:
            said = self.platform.cancel(job_id, by="bench", reason="next run")
            first = first or said
            try:
                return first, handle.wait(CANCEL_WAIT)
            except TimeoutError:
                self.check_worker()
                if time.monotonic() > deadline:
                    raise BenchError(f"run {index}: holder not terminal; {self.describe(job_id)}") from None
                self.recancels += 1
                log(f"  run {index}: cancel() said {said!r} but the holder kept running; cancelling again")

    def describe(self, job_id: str) -> str:
        """A job's status, attempt and event topics, for a failure message."""
        handle = self.platform.job(job_id)
        row = handle.row()
        topics = [e.topic for e in handle.events()[0]]
        return f"job {job_id}: {row['status']} attempt {row['attempts']}, events {topics}"

    # -- one run ---------------------------------------------------------------------

    def run_once(self, index: int) -> Run:
        """Holder running, preemptor submitted, preemptor body started; then clean up."""
        p = self.platform
        user = f"u-{self.tag}-{index}"
        note = f"sync-{self.tag}-{index}"
        wnote = f"write-{self.tag}-{index}"
        holder = p.submit(SYNC, {"user": user, "note": note, **SYNC_PAYLOAD})
        self.wait_marker(f"{note}:start:1", HOLDER_POLL, START_TIMEOUT)
        if self.phase_ms > 0:
            time.sleep(random.uniform(0.0, self.phase_ms / 1000))

        t0 = time.monotonic()
        preemptor = p.submit(WRITE, {"user": user, "note": wnote})
        submitted = time.monotonic()
        marker = self.wait_marker(f"{wnote}:start", MARKER_POLL, PREEMPT_TIMEOUT)
        seen = time.monotonic()

        status, holder_status = self.stop_holder(holder.id, index)
        try:
            preemptor_status = preemptor.wait(30)
        except TimeoutError as exc:
            self.check_worker()
            raise BenchError(f"run {index}: {exc}; {self.describe(preemptor.id)}") from None
        if preemptor_status != "succeeded":
            raise BenchError(f"preemptor {preemptor.id} ended {preemptor_status}")
        row = preemptor.row()
        created: dt.datetime = row["created_at"]
        cleanup = self.marker_at(f"{note}:cleanup:1")
        released = self.event_at(holder.id, "job.preempted")
        if released is None:
            raise BenchError(f"run {index}: the holder was never preempted; {self.describe(holder.id)}")
        if self.event_at(holder.id, "job.interrupt_sent") is not None:
            self.escalations += 1  # it missed its checkpoints for the whole grace period

        def ms(at: dt.datetime | None) -> float | None:
            return None if at is None else (at - created).total_seconds() * 1000

        log(
            f"  run {index}: {(seen - t0) * 1000:7.1f} ms (db clock {ms(marker):6.1f}: claim "
            f"{ms(row['started_at']):5.1f}, holder noticed {_fmt(ms(cleanup))}, released "
            f"{_fmt(ms(released))}); cancel -> {status}, holder {holder_status}"
        )
        return Run(
            latency_ms=(seen - t0) * 1000,
            db_ms=ms(marker) or 0.0,
            claim_ms=ms(row["started_at"]) or 0.0,
            noticed_ms=ms(cleanup),
            released_ms=ms(released),
            submit_ms=(submitted - t0) * 1000,
            holder_status=holder_status,
        )


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.1f}"


def summarize(runs: Sequence[Run]) -> None:
    """Medians of the breakdown, on stderr."""

    def med(values: Sequence[float | None]) -> str:
        present = [v for v in values if v is not None]
        return f"{statistics.median(present):.1f}" if present else "n/a"

    log(
        f"medians (ms): bench {med([r.latency_ms for r in runs])}, db clock {med([r.db_ms for r in runs])}, "
        f"submit call {med([r.submit_ms for r in runs])}, claim {med([r.claim_ms for r in runs])}, "
        f"holder noticed {med([r.noticed_ms for r in runs])}, "
        f"released {med([r.released_ms for r in runs])}"
    )
    log(
        f"db clock p95 {percentile([r.db_ms for r in runs], 0.95):.1f} ms; "
        f"holder outcomes: {sorted({r.holder_status for r in runs})}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=50, help="measured runs (default 50)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured runs first (default 2)")
    parser.add_argument("--smoke", action="store_true", help="CI: 3 runs, 1 warm-up run")
    parser.add_argument(
        "--phase", type=float, default=0.0, help="random delay before the submit, up to this many ms"
    )
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.warmup = 3, 1
    if args.runs < 1 or args.warmup < 0 or args.phase < 0:
        parser.error("--runs must be positive, --warmup and --phase not negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-preempt-")
    redis_url, database_url, home = services.redis_url, services.database_url, services.home
    bench: PreemptionBench | None = None
    runs: list[Run] = []
    try:
        platform = open_platform()
        bench = PreemptionBench(platform=platform, home=home, phase_ms=args.phase)
        log(
            f"preemption: runs={args.runs} warmup={args.warmup} phase={args.phase:g}ms redis={redis_url} "
            f"db={database_url} home={home}"
        )
        bench.start_worker()
        for i in range(args.warmup):
            bench.run_once(-1 - i)
        for i in range(args.runs):
            runs.append(bench.run_once(i))
        summarize(runs)
        log(f"holders interrupted by the grace-period escalation: {bench.escalations}")
        if bench.recancels:
            log(f"holders that ignored a first cancel() (cancel/claim race): {bench.recancels}")
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            bench.stop_worker()
            bench.platform.reset()
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    latencies = [r.latency_ms for r in runs]
    print(f"preemption_p50_ms={percentile(latencies, 0.5):.1f}")
    print(f"preemption_p95_ms={percentile(latencies, 0.95):.1f}")
    print(f"runs={len(runs)}")
    return 0


if __name__ == "__main__":
    # Run as ``python bench/preemption.py`` or ``python -m bench.preemption``: the project
    # root must be importable (config/, tasks/), as it is for the worker through PYTHONPATH.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
