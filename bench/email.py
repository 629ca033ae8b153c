"""Email family: N sends through Conveyor against plain Celery, to a local aiosmtpd peer.

Both sides send the same kind of message (one recipient, the same subject and ~2 KB of HTML,
each message its own outboxId and ``Message-ID``) with the same client
(:class:`tasks.email.providers.smtp.SmtpProvider`, one SMTP connection per message) to an
:class:`pipelines.email.peers.SmtpPeer` running in the bench process (a fresh one per run),
from a real ``celery worker -P prefork`` subprocess with the same concurrency (``-c 10``,
the seed's), the same Celery config dict (:func:`conveyor.delivery.celeryconfig.celery_config`)
on the same Redis, Celery's own per-task rate limits off on both
(``worker_disable_rate_limits``), and the same submitting: ``--submitters`` threads (4).
One worker runs at a time; runs are interleaved (tracked, raw, ...), each with a fresh
worker, a fresh peer and an untimed warm-up of ``2 x concurrency`` messages; medians are
reported.

* tracked: ``conveyor worker -Q email`` (stage ``conveyor.email.send``), worker env
  ``CONVEYOR_EMAIL={"smtp": {"port": <peer>}, "from_address": ..., "allow_test_domains":
  true}`` and ``CONVEYOR_RATE_LIMITS={}``. The bench calls
  :func:`pipelines.email.messages.send_email` N times with the same ``html`` (stored once;
  each call writes the outbox row and the job in one transaction). Timed from the first call
  until every outbox row of the run (its own ``companyId``) is ``SENT`` and the peer counted
  N (polled every 50 ms). ``send_p95_ms``: the 95th percentile of ``sent_at - created_at``
  of the outbox rows (database clock both). N messages are submitted as one burst, so when
  the worker is the bottleneck this is mostly waiting in the queue, not one send's cost.
* raw: a plain Celery app (:data:`raw_app`: no Conveyor base class, no database) on queue
  ``email_raw``; its task builds the same :class:`tasks.email.providers.OutgoingEmail` (the
  HTML travels in the message) and calls ``SmtpProvider.send(..., before_commit_point=
  lambda: None)``. ``delay()`` N times; timed until the peer counted N and every result is
  ``SUCCESS`` in the Redis result backend (MGET polling).

``ratio`` = tracked ``emails_per_s`` / raw ``emails_per_s`` (= raw wall time / tracked wall
time; below 1: Conveyor is slower), like ``ratio`` in bench/throughput.py;
``overhead_ratio`` is its inverse, bench/files.py's convention.

**Rate-limited run** (tracked, once, after the others): the worker with
``CONVEYOR_RATE_LIMITS='{"email": {"rate": 100}}'`` (``--limit-rate``): a token bucket per
queue in Redis: a fresh job takes its token at publish or is held back ``throttled`` until
its own reserved token time (the relay publishes it then), and the worker's claim runs it
on that reservation; a delivery still over the limit is parked again.
After the same warm-up and a 1 s pause (the bucket refills), ``rate x 40`` messages (4,000)
are submitted with the worker running; the peer's count is
sampled every 100 ms and ``limited_rate`` is deliveries per second over a 30 s window from
5 s after the first delivery (past the bucket's initial burst). ``deliveries_per_send`` =
broker deliveries consumed ÷ messages, counted in the database as ``Σ jobs.attempts`` (each
claim) + ``job.rate_limited`` events of the worker (each delivery parked without a claim;
a job the submitter held back until its token time, ``"at": "publish"``, was not delivered
then); a redelivery
dropped as a duplicate is in neither, so it is a lower bound (none happen without faults).
If no job was parked the limit never bound (the worker is slower than it): stderr says so,
and ``limited_rate`` is then the worker's capacity, not the limiter's accuracy.
``--smoke`` keeps a short limited run (a 1.5 s window from 0.5 s; a rough figure).

Usage (as a module: run as a file, ``bench/`` would shadow the standard library's ``email``)::

    .venv/bin/python -m bench.email                  # N=10,000, 3 runs per side, limited run
    .venv/bin/python -m bench.email --smoke          # CI: N=60, 1 run, a short limited run
    .venv/bin/python -m bench.email --n 2000 --runs 1 --limit-rate 20

Progress and each side's configuration go to stderr; stdout carries only ``name=value``
lines: ``emails_per_s``, ``send_p95_ms``, ``raw_celery_emails_per_s``, ``ratio``,
``overhead_ratio``, ``limited_rate``, ``limited_rate_limit``, ``limited_rate_seed`` (100: the
seed's BullMQ limiter, ``max: 100`` per 1000 ms, its configuration, not a measurement),
``limited_rate_goal`` (``95..105``, scaled with ``--limit-rate``), ``limited_window_s``,
``deliveries_per_send``, ``deliveries_per_send_goal`` (``<=1.2``), ``n``, ``runs``,
``concurrency``; with ``--no-limited`` the limited figures print ``skipped``.

The message, the raw side (its Celery app, started as ``celery -A bench.email_parts:raw_app``)
and the rate arithmetic are in :mod:`bench.email_parts`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from celery.result import AsyncResult
from sqlalchemy import func, select

from bench.common import (
    POLL_INTERVAL,
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
from bench.email_parts import (
    HTML,
    RAW_APP,
    RAW_QUEUE,
    SUBJECT,
    configure_raw_app,
    email_env,
    fan_out,
    payload,
    raw_app,
    raw_send,
    steady_rate,
)
from tasks.email import tables as t

if TYPE_CHECKING:
    from redis import Redis

    from conveyor.platform import Platform
    from pipelines.email.peers import SmtpPeer

T = TypeVar("T")
QUEUE = "email"  # config/queues.py
QUEUES = (QUEUE, RAW_QUEUE)
REDIS_DB = 15
DATABASE = "conveyor_bench_email"
DEFAULT_N = 10_000
SMOKE_N = 60
DEFAULT_CONCURRENCY = 10  # the seed's worker concurrency
DEFAULT_SUBMITTERS = 4
IDLE_PAUSE = 0.5
LIMIT_RATE = 100.0
# (warm-up, window, slack) in seconds: the limited run sends rate x their sum messages.
LIMITED = (5.0, 30.0, 5.0)
SMOKE_LIMITED = (0.5, 1.5, 0.5)
SAMPLE_INTERVAL = 0.1
SEED_RATE, RATE_TOLERANCE, DELIVERIES_GOAL = 100, 5, 1.2
# Passed to both workers after ``--`` (Celery's command-line config, namespace ``worker``).
NO_RATE_LIMITS = ("--", "worker_disable_rate_limits=true")

# -- measurements ------------------------------------------------------------------------


@dataclass
class Timed:
    """One timed run: wall seconds, seconds spent submitting, the tracked p50/p95 (ms)."""

    result: RunResult
    p50_ms: float = 0.0
    p95_ms: float = 0.0


@dataclass
class Limited:
    """The rate-limited run's figures."""

    rate: float
    window_s: float
    deliveries_per_send: float


@dataclass
class Bench:
    """Everything one benchmark invocation needs: services, platform, options."""

    platform: Platform
    redis: Redis
    n: int
    concurrency: int
    submitters: int
    home: Path
    tracked_jobs: int = 0
    results: list[Timed] = field(default_factory=list)
    worker: BenchWorker = field(init=False)
    peer: SmtpPeer | None = None
    base: int = 0

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)

    # -- workers and peers -------------------------------------------------------------

    def start(self, side: str, name: str, rate_limits: str = "{}") -> None:
        """A fresh peer, then the worker of ``side`` pointed at it; waits until it answers."""
        from pipelines.email.peers import SmtpPeer

        self.peer, self.base = SmtpPeer().start(), 0
        settings, app, queues = self.platform.settings, self.platform.app, [QUEUE]
        if side == "raw":
            settings, app, queues = settings.model_copy(update={"app": RAW_APP}), raw_app, [RAW_QUEUE]
        env = {"CONVEYOR_EMAIL": email_env(self.peer.port), "CONVEYOR_RATE_LIMITS": rate_limits}
        hostname = self.worker.start(
            settings,
            app,
            name=name,
            queues=queues,
            concurrency=self.concurrency,
            extra_env=env,
            extra_args=NO_RATE_LIMITS,
        )
        replies = app.control.inspect(destination=[hostname], timeout=2.0).conf() or {}
        if (replies.get(hostname) or {}).get("worker_disable_rate_limits") is not True:
            raise BenchError(f"worker {hostname} runs with Celery's rate limits enabled")

    def stop(self) -> None:
        """Warm-stop the worker after its last ack reached Redis, then the peer."""
        try:
            if self.worker.proc is not None:
                try:
                    wait_drained(self.redis, QUEUES)
                finally:
                    self.worker.stop()
        finally:
            if self.peer is not None:
                self.peer.stop()
                self.peer = None

    def delivered(self) -> int:
        """Messages the current peer took since :meth:`rebase`."""
        assert self.peer is not None
        return self.peer.count - self.base

    @staticmethod
    def timeout(n: int) -> float:
        """How long ``n`` sends may take before the run is declared broken."""
        return max(120.0, n * 0.25)

    # -- tracked side ------------------------------------------------------------------

    def submit_tracked(self, company: str, n: int) -> None:
        """``send_email`` ``n`` times from ``submitters`` threads, the same HTML each time."""
        from pipelines.email.messages import send_email

        fan_out(self.submitters, n, lambda i: send_email(self.platform, payload(company, i), html=HTML))
        self.tracked_jobs += n

    def sent_count(self, company: str) -> int:
        """Outbox rows of ``company`` that are ``SENT``."""
        query = select(func.count()).where(t.outbox.c.company_id == company, t.outbox.c.status == t.SENT)
        with self.platform.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def wait_tracked(self, company: str, n: int, start: float) -> float:
        """Seconds from ``start`` until ``n`` rows of ``company`` are ``SENT`` and the peer took them."""
        deadline = time.monotonic() + self.timeout(n)
        while self.sent_count(company) < n or self.delivered() < n:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"tracked: {self.sent_count(company)} of {n} SENT, peer took {self.delivered()}"
                )
            self.worker.check()
            time.sleep(POLL_INTERVAL)
        end = time.perf_counter() - start
        if self.delivered() != n:
            raise BenchError(f"tracked: the peer took {self.delivered()} messages for {n} sends")
        check_all_succeeded(self.platform, self.tracked_jobs)
        return end

    def latencies(self, company: str) -> tuple[float, float]:
        """p50 and p95 of ``sent_at - created_at`` (ms) over ``company``'s outbox rows."""
        age = func.extract("epoch", t.outbox.c.sent_at - t.outbox.c.created_at) * 1000.0
        query = select(
            func.percentile_cont(0.5).within_group(age), func.percentile_cont(0.95).within_group(age)
        ).where(t.outbox.c.company_id == company)
        with self.platform.engine.connect() as conn:
            p50, p95 = conn.execute(query).one()
        return float(p50), float(p95)

    def run_tracked(self, run: int) -> Timed:
        """One timed tracked run with a fresh worker and peer."""
        self.start("tracked", f"email-tracked-{run}")
        try:
            warm = str(uuid.uuid4())
            self.submit_tracked(warm, 2 * self.concurrency)
            self.wait_tracked(warm, 2 * self.concurrency, time.perf_counter())
            wait_drained(self.redis, QUEUES)
            self.rebase()
            time.sleep(IDLE_PAUSE)
            company = str(uuid.uuid4())
            start = time.perf_counter()
            self.submit_tracked(company, self.n)
            submitted = time.perf_counter() - start
            seconds = self.wait_tracked(company, self.n, start)
            p50, p95 = self.latencies(company)
        finally:
            self.stop()
        log(f"  tracked submit → SENT: p50 {p50:.0f} ms, p95 {p95:.0f} ms")
        return Timed(RunResult("tracked", self.n, seconds, submitted), p50, p95)

    def rebase(self) -> None:
        """Count the peer's messages from now on (after a warm-up)."""
        assert self.peer is not None
        self.base = self.peer.count

    # -- raw side ----------------------------------------------------------------------

    def raw_batch(self, n: int) -> tuple[float, float]:
        """``delay()`` ``n`` sends; seconds to submitted and until the peer took them all and
        every result is in the backend."""
        start = time.perf_counter()

        def send(i: int) -> AsyncResult:
            data = payload("raw", i)
            return raw_send.delay(data["outboxId"], data["to"], SUBJECT, HTML)

        results = fan_out(self.submitters, n, send)
        submitted = time.perf_counter() - start
        deadline = time.monotonic() + self.timeout(n)
        while self.delivered() < n:
            if time.monotonic() > deadline:
                raise BenchError(f"raw: the peer took {self.delivered()} of {n} messages")
            self.worker.check()
            time.sleep(POLL_INTERVAL)
        peer_done = time.perf_counter() - start
        # MGET polling of the result keys (as bench/throughput.py): submissions came from
        # several threads, so the per-thread pub/sub result consumer cannot be relied on.
        ids = [r.id for r in results]
        wait = max(1.0, deadline - time.monotonic())
        metas = dict(raw_app.backend.get_many(ids, timeout=wait, interval=POLL_INTERVAL))
        end = time.perf_counter() - start
        failed = sum(1 for i in ids if metas[i]["status"] != "SUCCESS")
        if failed or self.delivered() != n:
            raise BenchError(f"raw: {failed} of {n} sends failed, peer took {self.delivered()}")
        if end - peer_done > 0.5:
            log(f"  raw: peer had all at {peer_done:.2f}s, results at {end:.2f}s")
        return submitted, end

    def run_raw(self, run: int) -> Timed:
        """One timed raw-Celery run with a fresh worker and peer."""
        self.start("raw", f"email-raw-{run}")
        try:
            self.raw_batch(2 * self.concurrency)
            wait_drained(self.redis, QUEUES)
            self.rebase()
            time.sleep(IDLE_PAUSE)
            submitted, seconds = self.raw_batch(self.n)
        finally:
            self.stop()
        return Timed(RunResult("raw", self.n, seconds, submitted))

    # -- the rate-limited run ----------------------------------------------------------

    def run_limited(self, rate: float, warmup: float, window: float, slack: float) -> Limited:
        """Sends under ``{"email": {"rate": rate}}``; the steady rate and deliveries per send."""
        n = round(rate * (warmup + window + slack))
        log(f"limited run: {n} sends, CONVEYOR_RATE_LIMITS={{'{QUEUE}': {{'rate': {rate:g}}}}}")
        rate_limits = json.dumps({QUEUE: {"rate": rate}})
        self.start("tracked", "email-limited", rate_limits=rate_limits)
        from conveyor.settings import RateLimit

        # The deployment's setting, read by every process: the submitter too, which holds a
        # job back until its token time instead of having the worker park it.
        before = dict(self.platform.settings.rate_limits)
        self.platform.settings.rate_limits[QUEUE] = RateLimit(rate=rate)
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_INTERVAL):
                samples.append((time.perf_counter(), self.delivered()))

        sampler = threading.Thread(target=sample, name="peer-sampler", daemon=True)
        company = str(uuid.uuid4())
        try:
            warm = str(uuid.uuid4())
            self.submit_tracked(warm, 2 * self.concurrency)  # under the limit: one burst's worth
            self.wait_tracked(warm, 2 * self.concurrency, time.perf_counter())
            wait_drained(self.redis, QUEUES)
            self.rebase()
            time.sleep(1.0)  # the bucket refills
            sampler.start()
            start = time.perf_counter()
            self.submit_tracked(company, n)
            submitted = time.perf_counter() - start
            log(f"  limited: {n} submitted in {submitted:.1f}s ({n / submitted:.0f}/s)")
            if n / submitted < rate * 1.1:
                log("  limited: submitted slower than the limit: the rate measures the submit, not it")
            self.wait_tracked(company, n, start)
            stop.set()
            sampler.join()
            deliveries, parked = self.deliveries(company)
        finally:
            stop.set()
            self.stop()
            self.platform.settings.rate_limits.clear()
            self.platform.settings.rate_limits.update(before)
        measured, span = steady_rate(samples, n, warmup, window)
        log(
            f"  limited: {measured:.1f}/s over {span:.1f}s from {warmup:.0f}s after the first delivery; "
            f"{deliveries} deliveries ({parked} parked over the limit) for {n} sends"
        )
        if measured < rate * 0.9:
            log("  limited: the rate stayed under the limit: it is the worker's capacity, not the limiter's")
        return Limited(measured, span, deliveries / n)

    def deliveries(self, company: str) -> tuple[int, int]:
        """Σ attempts of ``company``'s jobs plus their ``job.rate_limited`` events, and the latter."""
        from conveyor.store.db.schema import job_events, jobs

        ids = select(t.outbox.c.id).where(t.outbox.c.company_id == company)
        attempts = select(func.coalesce(func.sum(jobs.c.attempts), 0)).where(jobs.c.id.in_(ids))
        events = select(job_events.c.body).where(
            job_events.c.job_id.in_(ids), job_events.c.topic == "job.rate_limited"
        )
        with self.platform.engine.connect() as conn:
            # One held back at publish was never delivered: only the worker's parkings count.
            parkings = sum(
                1 for body in conn.execute(events).scalars() if (body or {}).get("at") != "publish"
            )
            return int(conn.execute(attempts).scalar_one()) + parkings, parkings

    # -- the whole thing -------------------------------------------------------------

    def run(self, runs: int) -> tuple[float, float, float]:
        """Interleave ``runs`` runs per side; median rates per side and the median p95 (ms)."""
        sides: list[tuple[str, Callable[[int], Timed]]] = [
            ("tracked", self.run_tracked),
            ("raw", self.run_raw),
        ]
        for run in range(runs):
            for side, fn in sides:
                if backlog(self.redis, QUEUES):
                    raise BenchError(f"queues not empty before the {side} run")
                timed = fn(run)
                self.results.append(timed)
                r = timed.result
                log(
                    f"run {run + 1}/{runs} {side:7s}: {r.per_second:8.1f} emails/s "
                    f"({r.seconds:.2f}s total, {r.submit_seconds:.2f}s submitting)"
                )
        tracked = statistics.median(x.result.seconds for x in self.results if x.result.side == "tracked")
        raw = statistics.median(x.result.seconds for x in self.results if x.result.side == "raw")
        p95 = statistics.median(x.p95_ms for x in self.results if x.result.side == "tracked")
        log(f"medians: tracked {tracked:.2f}s, raw {raw:.2f}s")
        return self.n / tracked, self.n / raw, p95


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"sends per run (default {DEFAULT_N})")
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"pool size, both sides (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--submitters",
        type=int,
        default=DEFAULT_SUBMITTERS,
        help=f"threads calling send_email / delay(), both sides (default {DEFAULT_SUBMITTERS})",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("--no-limited", action="store_true", help="skip the rate-limited run")
    parser.add_argument(
        "--limit-rate",
        type=float,
        default=LIMIT_RATE,
        help=f"the limited run's rate, per second (default {LIMIT_RATE:g}, the seed's)",
    )
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 1 run, a short limited run")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    args.limited = LIMITED
    if args.smoke:
        args.n, args.runs, args.limited = SMOKE_N, 1, SMOKE_LIMITED
    if min(args.n, args.runs, args.concurrency, args.submitters, args.limit_rate) <= 0:
        parser.error("--n, --runs, --concurrency and --submitters must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    from config import HAS_EMAIL

    args = parse_args(argv)
    if not HAS_EMAIL:
        log("the email family is off: install conveyor[email] (aiosmtpd, email-validator)")
        return 1
    services = prepare(args, prefix="conveyor-bench-email-")
    # The bench process only submits: its CONVEYOR_EMAIL gives the Message-ID domain and lets
    # .test addresses through validation; each worker gets its peer's port.
    os.environ["CONVEYOR_EMAIL"] = email_env(25)
    os.environ.pop("CONVEYOR_RATE_LIMITS", None)
    home = services.home
    bench: Bench | None = None
    limited: Limited | None = None
    try:
        platform = open_platform()
        from tasks.email.models import allow_test_domains

        allow_test_domains(True)
        configure_raw_app(platform.settings)
        bench = Bench(
            platform=platform,
            redis=services.redis,
            n=args.n,
            concurrency=args.concurrency,
            submitters=args.submitters,
            home=home,
        )
        log(
            f"email: n={args.n} runs={args.runs} concurrency={args.concurrency} (prefork, both sides) "
            f"submitters={args.submitters} threads (both sides) redis={services.redis_url} "
            f"db={services.database_url} home={home}"
        )
        log(f"  tracked: conveyor worker -Q {QUEUE}, send_email (HTML stored once, shared)")
        log(f"  raw: celery -A {RAW_APP} worker -Q {RAW_QUEUE}, delay() (HTML in each message), no database")
        log("  both: SmtpProvider -> an in-process aiosmtpd peer, one SMTP connection per message")
        tracked, raw, p95 = bench.run(args.runs)
        if args.no_limited:
            log("limited run skipped (--no-limited): its figures print 'skipped'")
        else:
            warmup, window, slack = args.limited
            if args.smoke:
                log(f"limited run (smoke): a {window:.0f}s window, rough; full runs use {LIMITED[1]:.0f}s")
            limited = bench.run_limited(args.limit_rate, warmup, window, slack)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            try:
                bench.stop()
            except BenchError as exc:
                log(f"cleanup: {exc}")
            bench.platform.reset()
        raw_app.close()
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    print(f"emails_per_s={tracked:.1f}")
    print(f"send_p95_ms={p95:.0f}")
    print(f"raw_celery_emails_per_s={raw:.1f}")
    print(f"ratio={tracked / raw:.3f}")
    print(f"overhead_ratio={raw / tracked:.3f}")
    print(f"limited_rate={f'{limited.rate:.1f}' if limited else 'skipped'}")
    print(f"limited_rate_limit={args.limit_rate:g}")
    print(f"limited_rate_seed={SEED_RATE}")
    low, high = (args.limit_rate * (1 + k * RATE_TOLERANCE / SEED_RATE) for k in (-1, 1))
    print(f"limited_rate_goal={low:g}..{high:g}")
    print(f"limited_window_s={f'{limited.window_s:.1f}' if limited else 'skipped'}")
    print(f"deliveries_per_send={f'{limited.deliveries_per_send:.3f}' if limited else 'skipped'}")
    print(f"deliveries_per_send_goal=<={DELIVERIES_GOAL}")
    print(f"n={args.n}")
    print(f"runs={args.runs}")
    print(f"concurrency={args.concurrency}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
