"""Trading family: the seed's SLOs through real workers and local peers (issue #33's
benchmark): import, the ``coach.reflect`` push, sims, weekly digests.

**The world.** :class:`pipelines.trading.peers.TradingPeers` in the bench process on
loopback, set as the seed has it: the broker serves 50 trades a page, 150 ms a page,
5 requests/s per token (``page_size=50, latency_ms=150, rate_per_s=5``); the AI coach
answers in 20 ms; market data in 30 ms. Two real ``conveyor worker -Q
q_import,q_score,q_sim,q_digest -c 3`` prefork processes get ``CONVEYOR_TRADING`` naming
the peers (a fresh Fernet token key and HMAC secret per run; the seed's defaults
otherwise: stage concurrency import 2, score 2, sim 4, digest 1 across the workers, score
batches of 200, ``rate_limit_safety_ms`` 250). Users' rows come from
:func:`pipelines.trading.peers.broker.sample_trades` (coinbase) with their times spread
evenly over a window the bench chooses. Redis DB 13 (flushed) and the database
``conveyor_bench_trading`` (dropped, created) are the bench's own.

**Figures** (stdout ``name=value``, each with ``name_seed=`` and ``name_goal=`` = seed / 10;
progress and the configuration on stderr):

* ``import_500_p95_s`` (group ``import``): submit -> ``wait()`` returns ``succeeded`` for an
  import of 500 trades (the last 29 days), a fresh user per run, 10 runs one after the
  other. Each import then submits its score (500 trades, 3 batches), which runs on while
  the next imports do: later imports share the two cores with earlier users' scores.
* ``reflect_push_median_ms``, ``reflect_push_p95_ms`` (group ``reflect``): an SSE client of
  ``GET /events/stream`` (``conveyor serve`` in a subprocess, an admin token), opened before
  the first import, times every ``coach.reflect`` of those scores: receive time minus its
  batch's commit. *The commit* is the score cursor's ``updated_at`` (``clock_timestamp()``,
  written last in the batch's transaction, so a little before the commit itself), read as
  soon as the batch's first event arrives; should the row already hold a later batch, the
  latest ``created_at`` of the batch's events (counted on stderr). The database and the
  bench share this host's clock. Every event of a batch is one sample (200 per batch). *The
  stream* reads the outbox again when a commit announces events through Redis (one
  subscriber per server process; reads at most every 50 ms) and every 0.5 s anyway
  (:mod:`conveyor.web.events` as it is when the bench runs).
* ``sim_cold_p95_ms``, ``sim_cached_p95_ms``, ``sim_result_hit_p95_ms`` (group ``sim``):
  submit -> ``wait()`` returns for ``horizonDays`` 7 on 20 trades of an imported user (after
  every score finished), per trade in this order: cold (``trading:sim:{user}:*`` and
  ``trading:ohlcv:*`` deleted: one OHLCV request to the market peer), cached (only the
  user's results deleted: the OHLCV cache warm from the cold run of the same trade), result
  hit (nothing deleted). Each is submitted after the previous one finished (the stage's
  dedup returns a pending job).
* ``digest_per_user_s`` (group ``digest``): submit -> ``wait()`` for a user's week of 100
  trades, tagged by their score first (setup, untimed), 20 users one after the other, p95.

``--only import,reflect,sim,digest`` runs some groups (reflect alone imports 4 users; sim
alone imports one user of 100 trades first). Figures are benchmark output, never
assertions: the bench exits 1 only when a job fails or does not end, when trades, tags or
``coach.reflect`` events are missing, or when a stream loses one.

``--smoke`` (CI, < 90 s): imports of 2 users x 100 trades (their 200 reflect events timed),
3 trades' sims, 3 digest users; the same lines.

Usage::

    .venv/bin/python -m bench.trading                 # the full run (about 5 minutes)
    .venv/bin/python -m bench.trading --smoke         # CI
    .venv/bin/python -m bench.trading --only sim,digest
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from bench.common import BenchError, BenchWorker, add_service_args, log, open_platform, prepare
from bench.trading_parts import ReflectClock, delete_keys, percentile, serving, spread_rows
from tasks.trading.settings import trading_settings_of

if TYPE_CHECKING:
    from redis import Redis

    from conveyor.platform import Platform
    from pipelines.trading.peers import TradingPeers

REDIS_DB = 13
DATABASE = "conveyor_bench_trading"
QUEUES = ("q_import", "q_score", "q_sim", "q_digest")  # tasks/trading/settings.py
WORKERS, CONCURRENCY = 2, 3
GROUPS = ("import", "reflect", "sim", "digest")
PAGE_SIZE, BROKER_LATENCY_MS, BROKER_RATE_PER_S = 50, 150, 5
AI_LATENCY_MS, MARKET_LATENCY_MS = 20, 30
HORIZON_DAYS = 7
DIGEST_TRADES = 100
SEEDS = {
    "import_500_p95_s": 60,
    "reflect_push_median_ms": 1500,
    "reflect_push_p95_ms": 3000,
    "sim_cached_p95_ms": 1000,
    "sim_cold_p95_ms": 3000,
    "digest_per_user_s": 5,
}


@dataclass(frozen=True)
class Mode:
    """How much one invocation runs."""

    import_users: int
    import_trades: int
    reflect_users: int  # when reflect runs without import
    sim_trades: int
    digest_users: int


FULL = Mode(import_users=10, import_trades=500, reflect_users=4, sim_trades=20, digest_users=20)
SMOKE = Mode(import_users=2, import_trades=100, reflect_users=2, sim_trades=3, digest_users=3)


def utcnow() -> dt.datetime:
    """Now, aware UTC, whole seconds."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


@dataclass
class Bench:
    """One run: the platform, the peers, the workers, what was measured."""

    platform: Platform
    peers: TradingPeers
    redis: Redis
    home: Path
    mode: Mode
    run: str = field(default_factory=lambda: secrets.token_hex(3))
    workers: list[BenchWorker] = field(default_factory=list)
    users: list[str] = field(default_factory=list)  # imported and scored, trades over 29 days
    figures: dict[str, str] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)

    def start_workers(self, env: dict[str, str]) -> None:
        """``WORKERS`` real prefork workers on the four queues."""
        for i in range(WORKERS):
            worker = BenchWorker(self.home)
            self.workers.append(worker)
            worker.start(
                self.platform.settings,
                self.platform.app,
                name=f"trading-{i}",
                queues=QUEUES,
                concurrency=CONCURRENCY,
                extra_env=env,
            )

    def connect(self, user: str, n: int, start: dt.datetime, end: dt.datetime, seed: int) -> None:
        """``user`` at the broker peer with ``n`` trades over ``[start, end)``, connected."""
        from pipelines.trading.jobs import connect_broker
        from pipelines.trading.peers.broker import sample_trades

        rows = spread_rows(sample_trades("coinbase", n, start=start, seed=seed), start, end)
        token = secrets.token_urlsafe(18)
        self.peers.broker.set_user(user, "coinbase", token, rows)
        connect_broker(self.platform, user, "coinbase", token)

    def wait_ok(self, handle: Any, what: str, timeout: float) -> Any:
        """``handle``'s result once it succeeded; BenchError if it failed or did not end."""
        from conveyor.store.db.schema import SUCCEEDED

        try:
            status = handle.wait(timeout)
        except TimeoutError:
            status = f"not done after {timeout:g}s"
        if status != SUCCEEDED:
            for worker in self.workers:
                worker.check()
            raise BenchError(f"{what} ({handle.id}): {status}")
        return handle.result

    def add(self, name: str, value: float, digits: int = 0) -> None:
        """A figure, with its seed and goal when it has one."""
        self.figures[name] = f"{value:.{digits}f}"
        if name in SEEDS:
            self.figures[f"{name}_seed"] = str(SEEDS[name])
            self.figures[f"{name}_goal"] = f"{SEEDS[name] / 10:g}"

    def lost(self, problem: str) -> None:
        """Something the run promised did not hold (exit 1)."""
        log(f"  broken: {problem}")
        self.broken.append(problem)


def import_phase(bench: Bench, users: int, trades: int) -> list[float]:
    """Import ``users`` fresh users of ``trades`` trades one after the other (seconds each),
    then wait for their scores."""
    from pipelines.trading.jobs import submit_import

    end = utcnow() - dt.timedelta(hours=1)
    start = end - dt.timedelta(days=29)
    seconds: list[float] = []
    scores: list[tuple[str, Any]] = []
    for i in range(users):
        user = f"imp-{bench.run}-{i}"
        bench.connect(user, trades, start, end, seed=i)
        began = time.perf_counter()
        handle = submit_import(bench.platform, user)
        result = bench.wait_ok(handle, f"import of {user}", 300)
        seconds.append(time.perf_counter() - began)
        log(f"  import {i + 1}/{users}: {seconds[-1]:.2f}s ({result['pages']} pages)")
        if result["stored"] != trades:
            bench.lost(f"import of {user} stored {result['stored']} of {trades} trades")
        scores.append((user, bench.platform.job(result["score_job"])))
    for user, score in scores:
        result = bench.wait_ok(score, f"score of {user}", 900)
        if result["reflected"] != trades:
            bench.lost(f"score of {user} told {result['reflected']} of {trades} trades")
        bench.users.append(user)
    log(f"  {users} scores done")
    return seconds


def import_and_reflect(bench: Bench, groups: set[str]) -> None:
    """The ``import`` and ``reflect`` groups: one import phase, the stream open over it when
    ``reflect`` runs."""
    from conveyor.web import tokens

    mode = bench.mode
    users = mode.import_users if "import" in groups else mode.reflect_users
    trades = mode.import_trades
    log(f"import: {users} users x {trades} trades, one at a time")
    clock: ReflectClock | None = None
    if "reflect" not in groups:
        seconds = import_phase(bench, users, trades)
    else:
        token = tokens.create(bench.platform.engine, owner="bench", scopes=("admin",)).secret
        batch = trading_settings_of(bench.platform.settings).score_batch
        with serving(bench.platform, bench.home / "logs") as base:
            clock = ReflectClock(bench.platform, base, token, batch)
            clock.start()
            seconds = import_phase(bench, users, trades)
            clock.wait_for(users * trades, timeout=30)
        clock.finish()
    if "import" in groups:
        # The figure keeps its name in smoke (100 trades a user): import_trades says how many.
        bench.add("import_500_p95_s", percentile(seconds, 0.95), 2)
        bench.figures["import_median_s"] = f"{percentile(seconds, 0.5):.2f}"
        bench.figures["import_runs"] = str(len(seconds))
        bench.figures["import_trades"] = str(trades)
    if clock is not None:
        if clock.error is not None:
            log(f"  the stream ended: {clock.error}")
        if clock.count != users * trades:
            bench.lost(f"the stream delivered {clock.count} of {users * trades} coach.reflect events")
        bench.add("reflect_push_median_ms", percentile(clock.latencies_ms, 0.5))
        bench.add("reflect_push_p95_ms", percentile(clock.latencies_ms, 0.95))
        bench.figures["reflect_events"] = str(len(clock.latencies_ms))
        log(
            f"  reflect: {len(clock.latencies_ms)} events, max {max(clock.latencies_ms, default=0):.0f} ms, "
            f"{clock.from_cursor} timed from the cursor's updated_at"
        )


def sim_group(bench: Bench) -> None:
    """Cold, cached and result-hit sims of ``mode.sim_trades`` trades (module docstring)."""
    from pipelines.trading.jobs import submit_sim
    from tasks.trading import tables as t

    if not bench.users:
        log("sim: importing one user of 100 trades first")
        import_phase(bench, 1, 100)
    user = bench.users[0]
    latest = utcnow() - dt.timedelta(days=HORIZON_DAYS + 1)
    query = select(t.trades.c.id).where(t.trades.c.user_id == user, t.trades.c.ts <= latest)
    with bench.platform.engine.connect() as conn:
        ids = list(conn.execute(query.order_by(t.trades.c.ts)).scalars())
    n = min(bench.mode.sim_trades, len(ids))
    chosen = [ids[i * len(ids) // n] for i in range(n)]
    log(f"sim: {n} trades of {user}, horizonDays {HORIZON_DAYS}: cold, cached, result hit each")
    samples: dict[str, list[float]] = {"cold": [], "cached": [], "hit": []}
    last_id = ""

    def timed(trade: str, kind: str, clear: Callable[[], None]) -> None:
        nonlocal last_id
        clear()
        began = time.perf_counter()
        handle = submit_sim(bench.platform, user, trade, HORIZON_DAYS)
        if handle.id == last_id:
            raise BenchError("a sim submitted after the previous one finished was deduplicated")
        last_id = handle.id
        result = bench.wait_ok(handle, f"{kind} sim of {trade}", 60)
        samples[kind].append((time.perf_counter() - began) * 1000)
        if bool(result.get("cached")) != (kind == "hit") or result.get("partial"):
            bench.lost(
                f"{kind} sim of {trade}: cached={result.get('cached')} partial={result.get('partial')}"
            )

    def results() -> None:
        delete_keys(bench.redis, f"*trading:sim:{user}:*")

    def everything() -> None:
        results()
        delete_keys(bench.redis, "*trading:ohlcv:*")

    for trade in chosen:
        timed(trade, "cold", everything)
        timed(trade, "cached", results)
        timed(trade, "hit", lambda: None)
    bench.add("sim_cold_p95_ms", percentile(samples["cold"], 0.95))
    bench.add("sim_cached_p95_ms", percentile(samples["cached"], 0.95))
    bench.add("sim_result_hit_p95_ms", percentile(samples["hit"], 0.95))
    for kind, values in samples.items():
        log(f"  sim {kind}: median {percentile(values, 0.5):.0f} ms, p95 {percentile(values, 0.95):.0f} ms")


def digest_group(bench: Bench) -> None:
    """``mode.digest_users`` users' weeks of 100 tagged trades, one digest at a time."""
    from pipelines.trading.jobs import submit_digest, submit_import

    first = utcnow().date() - dt.timedelta(days=9)
    last = first + dt.timedelta(days=7)
    start = dt.datetime.combine(first, dt.time(), dt.UTC) + dt.timedelta(minutes=30)
    end = dt.datetime.combine(last, dt.time(), dt.UTC) - dt.timedelta(minutes=30)
    users = [f"dig-{bench.run}-{i}" for i in range(bench.mode.digest_users)]
    log(
        f"digest: {len(users)} users x {DIGEST_TRADES} trades in [{first}, {last}); "
        "importing and scoring first"
    )
    for i, user in enumerate(users):
        bench.connect(user, DIGEST_TRADES, start, end, seed=1000 + i)
    imports = [(user, submit_import(bench.platform, user)) for user in users]
    scores = []
    for user, handle in imports:
        result = bench.wait_ok(handle, f"import of {user}", 300)
        scores.append((user, bench.platform.job(result["score_job"])))
    for user, score in scores:
        if bench.wait_ok(score, f"score of {user}", 600)["reflected"] != DIGEST_TRADES:
            bench.lost(f"score of {user} did not tell every trade")
    seconds: list[float] = []
    for user in users:
        began = time.perf_counter()
        result = bench.wait_ok(submit_digest(bench.platform, user, first, last), f"digest of {user}", 120)
        seconds.append(time.perf_counter() - began)
        if result["trades"] != DIGEST_TRADES:
            bench.lost(f"digest of {user} counted {result['trades']} of {DIGEST_TRADES} trades")
    bench.add("digest_per_user_s", percentile(seconds, 0.95), 3)
    bench.figures["digest_median_s"] = f"{percentile(seconds, 0.5):.3f}"
    log(f"  digests: median {percentile(seconds, 0.5):.3f}s, max {max(seconds):.3f}s")


def check_jobs(bench: Bench) -> None:
    """Every job the run submitted succeeded; nothing dead-lettered."""
    from conveyor.store.db.schema import dead_letters

    with bench.platform.engine.connect() as conn:
        counts = bench.platform.store.count_by_status(conn)
        dead = int(conn.execute(select(func.count()).select_from(dead_letters)).scalar_one())
    log(f"jobs by status: {counts}; dead letters: {dead}")
    if set(counts) - {"succeeded"} or dead:
        bench.lost(f"jobs by status {counts}, {dead} dead letters")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="CI: small counts, the same lines")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"groups to run, of {','.join(GROUPS)}")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    return parser.parse_args(argv)


def trading_config(peers: TradingPeers, secret: str) -> dict[str, Any]:
    """``CONVEYOR_TRADING`` for the bench's peers (the seed's defaults otherwise)."""
    from cryptography.fernet import Fernet

    return {
        "broker_urls": {"coinbase": peers.broker.url, "binance": peers.broker.url},
        "market_url": peers.market.url,
        "ai_url": peers.coach.url,
        "ai_key_id": "bench",
        "ai_secret": secret,
        "token_key": Fernet.generate_key().decode(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the groups; print the ``name=value`` lines. Exit 1 only when something broke."""
    from config import HAS_TRADING

    args = parse_args(argv)
    groups = {g.strip() for g in args.only.split(",") if g.strip()}
    if not HAS_TRADING or not groups or groups - set(GROUPS):
        log(f"--only takes {','.join(GROUPS)}" if HAS_TRADING else "install conveyor[trading]")
        return 1
    mode = SMOKE if args.smoke else FULL
    services = prepare(args, prefix="conveyor-bench-trading-")
    from pipelines.trading.peers import TradingPeers

    secret = secrets.token_urlsafe(24)
    peers = TradingPeers(ai_key_id="bench", ai_secret=secret).start()
    peers.broker.faults(page_size=PAGE_SIZE, latency_ms=BROKER_LATENCY_MS, rate_per_s=BROKER_RATE_PER_S)
    peers.coach.faults(latency_ms=AI_LATENCY_MS)
    peers.market.faults(latency_ms=MARKET_LATENCY_MS)
    # The bench process connects users (it encrypts their tokens); the workers read them.
    os.environ["CONVEYOR_TRADING"] = json.dumps(trading_config(peers, secret))
    bench: Bench | None = None
    began = time.monotonic()
    try:
        platform = open_platform()
        bench = Bench(platform=platform, peers=peers, redis=services.redis, home=services.home, mode=mode)
        trading = trading_settings_of(platform.settings)
        log(
            f"trading ({'smoke' if args.smoke else 'full'}; "
            f"groups {','.join(g for g in GROUPS if g in groups)}): "
            f"{WORKERS} workers x {CONCURRENCY} (prefork) on {','.join(QUEUES)}; stage concurrency "
            f"{trading.concurrency}, score batch {trading.score_batch}, rate_limit_safety_ms "
            f"{trading.rate_limit_safety_ms}; broker {PAGE_SIZE} trades/page, {BROKER_LATENCY_MS} ms/page, "
            f"{BROKER_RATE_PER_S} req/s; AI {AI_LATENCY_MS} ms; market data {MARKET_LATENCY_MS} ms; "
            f"redis={services.redis_url} db={services.database_url} home={services.home}"
        )
        bench.start_workers({"CONVEYOR_TRADING": os.environ["CONVEYOR_TRADING"]})
        if groups & {"import", "reflect"}:
            import_and_reflect(bench, groups)
        if "sim" in groups:
            sim_group(bench)
        if "digest" in groups:
            digest_group(bench)
        check_jobs(bench)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {services.home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            for worker in bench.workers:
                worker.stop()
            bench.platform.reset()
        peers.stop()
        services.release()
    assert bench is not None
    shutil.rmtree(services.home, ignore_errors=True)
    log(f"done in {time.monotonic() - began:.0f}s")
    for name, value in bench.figures.items():
        print(f"{name}={value}")
    print(f"workers={WORKERS}")
    print(f"concurrency={CONCURRENCY}")
    print(f"broker_latency_ms={BROKER_LATENCY_MS}")
    print(f"ai_latency_ms={AI_LATENCY_MS}")
    print(f"market_latency_ms={MARKET_LATENCY_MS}")
    return 1 if bench.broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
