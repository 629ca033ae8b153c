"""The trading family's stages (the seed's workers, on the platform):

- ``conveyor.trading.import_trades`` (``q_import``): a user's broker trades, page by page
  (:mod:`tasks.trading.imports`), then the score of the same window.
- ``conveyor.trading.score_bias`` (``q_score``): bias tags and ``coach.reflect`` events
  (:mod:`tasks.trading.scoring`).
- ``conveyor.trading.simulate_simple`` (``q_sim``): hold vs. actual after a trade
  (:mod:`tasks.trading.sims`).
- ``conveyor.trading.digest_weekly`` (``q_digest``): a user's period in a snapshot, a row and
  ``digest.ready``; ``conveyor.trading.digest_fanout`` submits one per user of a week
  (:mod:`tasks.trading.digests`; the beat's ``trading-weekly-digests``).

One trading job per user at a time: every stage takes the lease ``trading:{userId}``, and
the priorities (sim 10, import 5, digest 3, score 0) decide who waits; import and score
are preemptable and resume from their committed cursor. The seed's deterministic job ids
are dedup keys over the fields as submitted: a repeat while the job is pending returns it
(``deduplicated``); a later one runs.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from config.settings import get_settings
from conveyor.context import JobContext
from conveyor.dedup import Dedup
from conveyor.errors import PermanentError
from conveyor.retry import Backoff, Schedule
from conveyor.shared import current_platform, stage
from conveyor.store.db.engine import reading
from tasks.files.storage import new_storage
from tasks.trading import digests, telemetry
from tasks.trading.broker import BrokerClient
from tasks.trading.coach import CoachClient
from tasks.trading.imports import Importer, check_since, day_of, db_emit, default_since, resume_point
from tasks.trading.market import MarketClient
from tasks.trading.models import (
    DIGEST_STAGE,
    FANOUT_STAGE,
    IMPORT_STAGE,
    LEASE_KEY,
    SCORE_STAGE,
    SIM_STAGE,
    DigestJob,
    FanoutJob,
    ImportJob,
    ScoreJob,
    SimJob,
)
from tasks.trading.scoring import Scorer, load_facts, resume_cursor
from tasks.trading.settings import QUEUES, SETTING, TradingSettings, trading_settings_of
from tasks.trading.sims import Simulator, cached, trade_of
from tasks.trading.tokens import check_job_owner, connected_broker, fernet, read_token

_SETTINGS = get_settings().trading


class NotConfigured(PermanentError):
    """A peer the stage needs has no URL (or key) in ``CONVEYOR_TRADING``."""


def _trading() -> TradingSettings:
    """The platform's ``CONVEYOR_TRADING`` (read when each job runs)."""
    return trading_settings_of(current_platform().settings, _SETTINGS)


def _today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


def _market(ctx: JobContext, settings: TradingSettings) -> MarketClient:
    """The market-data client, its OHLCV cached in the platform's Redis."""
    return MarketClient(
        _needed(settings.market_url, "market_url"),
        cache=ctx.services.connections.redis,
        cache_ttl=settings.ohlcv_cache_ttl,
        cache_prefix=f"{_prefix()}trading:ohlcv",
        on_429=telemetry.saw_429,
    )


def _prefix() -> str:
    """The deployment's Redis key prefix: the family's cache keys live beside Conveyor's."""
    return current_platform().settings.key_prefix


def _needed(value: str | None, what: str) -> str:
    if not value:
        raise NotConfigured(f"{SETTING}.{what} is not set: the trading stages need it")
    return value


@stage(
    IMPORT_STAGE,
    payload=ImportJob,
    queue=QUEUES["import"],
    priority=5,
    lease_key=LEASE_KEY,
    preemptable=True,
    max_attempts=6,  # the seed's 5 retries
    retry=Backoff(base=1, cap=60),
    concurrency=_SETTINGS.concurrency["import"],
    dedup=Dedup(mode="simple", key="{userId}|{sinceIso}|{broker}"),
    label=lambda p: f"import {p.userId}",
)
def import_trades(ctx: JobContext, p: ImportJob) -> dict[str, Any]:
    """Import the user's trades since ``sinceIso`` (default: the last 30 days), then
    submit their score; see :mod:`tasks.trading.imports`."""
    settings = _trading()
    today = _today()
    since = day_of(p.sinceIso) if p.sinceIso else default_since(today)
    check_since(since, today)
    platform = current_platform()
    with reading(ctx.services.connections.engine) as conn:
        check_job_owner(conn, p.userId, ctx.owner)
        broker = connected_broker(conn, p.userId, p.broker)
        token = read_token(conn, fernet(settings, platform.settings.resolved_home()), p.userId, broker)
        progress = resume_point(conn, ctx.job_id)
    url = _needed(settings.broker_urls.get(broker), f"broker_urls.{broker}")
    with BrokerClient(url) as client:
        importer = Importer(
            ctx,
            client,
            user_id=p.userId,
            broker=broker,
            token=token,
            since=since,
            safety_s=settings.rate_limit_safety_ms / 1000,
            emit=db_emit(ctx.services.store, ctx.job_id),
        )
        progress = importer.run(progress)
    # Only the trades no score tagged yet: an import again tells no trade twice.
    score = {"userId": p.userId, "sinceIso": since.isoformat(), "retag": False}
    score_job = ctx.submit(SCORE_STAGE, score)
    return {**progress.result(), "broker": broker, "since": since.isoformat(), "score_job": score_job}


@stage(
    SCORE_STAGE,
    payload=ScoreJob,
    queue=QUEUES["score"],
    priority=0,
    lease_key=LEASE_KEY,
    preemptable=True,
    max_attempts=3,  # the seed's chaos line: dead-lettered after 3 attempts
    retry=Backoff(base=1, cap=30),
    concurrency=_SETTINGS.concurrency["score"],
    dedup=Dedup(mode="simple", key="{userId}|{sinceIso}"),
    label=lambda p: f"score {p.userId}",
)
def score_bias(ctx: JobContext, p: ScoreJob) -> dict[str, Any]:
    """Tag the user's trades since ``sinceIso`` and emit one ``coach.reflect`` each; see
    :mod:`tasks.trading.scoring`."""
    settings = _trading()
    since = day_of(p.sinceIso) if p.sinceIso else default_since(_today())
    secret = settings.ai_secret.get_secret_value() if settings.ai_secret is not None else ""
    coach = CoachClient(
        _needed(settings.ai_url, "ai_url"),
        key_id=_needed(settings.ai_key_id, "ai_key_id"),
        secret=_needed(secret, "ai_secret"),
        timeout=settings.ai_timeout,
        on_request=telemetry.ai_request,
    )
    market = _market(ctx, settings)
    with reading(ctx.services.connections.engine) as conn:
        check_job_owner(conn, p.userId, ctx.owner)
        facts = load_facts(conn, p.userId, since, untagged_only=not p.retag)
        cursor = resume_cursor(conn, ctx.job_id)
    try:
        scorer = Scorer(
            ctx,
            coach,
            market,
            user_id=p.userId,
            since=since,
            batch=settings.score_batch,
            emit=db_emit(ctx.services.store, ctx.job_id),
        )
        cursor = scorer.run(facts, cursor)
    finally:
        coach.close()
        market.close()
    return {"trades": len(facts), **cursor.result(), "since": since.isoformat()}


@stage(
    SIM_STAGE,
    payload=SimJob,
    queue=QUEUES["sim"],
    priority=10,
    lease_key=LEASE_KEY,
    max_attempts=3,  # the seed's 2 retries, linear (1 s, 5 s)
    retry=Schedule((1, 5)),
    concurrency=_SETTINGS.concurrency["sim"],
    dedup=Dedup(mode="simple", key="{userId}|{tradeId}|{horizonDays}"),
    label=lambda p: f"sim {p.userId}",
)
def simulate_simple(ctx: JobContext, p: SimJob) -> dict[str, Any]:
    """Hold vs. actual after one trade; see :mod:`tasks.trading.sims`."""
    settings = _trading()
    redis = ctx.services.connections.redis
    if ctx.owner is not None:
        with reading(ctx.services.connections.engine) as conn:
            check_job_owner(conn, p.userId, ctx.owner)
    hit = cached(redis, _prefix(), p.userId, p.tradeId, p.horizonDays)
    if hit is not None:
        return hit
    with reading(ctx.services.connections.engine) as conn:
        trade = trade_of(conn, p.userId, p.tradeId)
    with _market(ctx, settings) as market:
        simulator = Simulator(market, redis, prefix=_prefix(), ttl=settings.sim_cache_ttl)
        now = dt.datetime.now(dt.UTC)
        return simulator.run(p.userId, p.horizonDays, trade, now, final=ctx.final_attempt)


@stage(
    DIGEST_STAGE,
    payload=DigestJob,
    queue=QUEUES["digest"],
    priority=3,
    lease_key=LEASE_KEY,
    max_attempts=4,  # the seed's 3 retries, exponential
    retry=Backoff(base=1, cap=60),
    concurrency=_SETTINGS.concurrency["digest"],
    dedup=Dedup(mode="id", fields=("userId", "periodStart", "periodEnd")),
    label=lambda p: f"digest {p.userId}",
)
def digest_weekly(ctx: JobContext, p: DigestJob) -> dict[str, Any]:
    """Aggregate the user's period, write its snapshot, record it and emit ``digest.ready``."""
    digests.check_period(p.periodStart, p.periodEnd, _today())
    settings = _trading()
    with reading(ctx.services.connections.engine) as conn:
        check_job_owner(conn, p.userId, ctx.owner)
        body = digests.summarize(conn, p.userId, p.periodStart, p.periodEnd)
    key, data = digests.snapshot(p.userId, p.periodStart, p.periodEnd, body)
    home = current_platform().settings.resolved_home()
    storage = new_storage(settings.s3, settings.storage_dir or home / "trading")
    ref = storage.put_bytes(key, data, "application/json")
    found = digests.record(ctx.connection, ctx.job_id, p.userId, p.periodStart, p.periodEnd, ref, body)
    period = {"start": p.periodStart.isoformat(), "end": p.periodEnd.isoformat()}
    ctx.emit("digest.ready", {"digestId": found, "userId": p.userId, "period": period})
    telemetry.committed("digest.ready")
    return {"digestId": found, "snapshot": ref, "trades": body["trades"], "period": period}


@stage(
    FANOUT_STAGE,
    payload=FanoutJob,
    queue=QUEUES["digest"],
    priority=3,
    max_attempts=3,
    retry=Backoff(base=1, cap=60),
    label=lambda p: "digest fan-out",
)
def digest_fanout(ctx: JobContext, p: FanoutJob) -> dict[str, Any]:
    """Submit one digest per user with trades in the week or a connection (each
    deduplicated by user and period, so a second firing adds nothing)."""
    start, end = digests.week_of(p.week, _today())
    with reading(ctx.services.connections.engine) as conn:
        users = digests.users_of_week(conn, start, end)
    for user in users:
        ctx.submit(
            DIGEST_STAGE, {"userId": user, "periodStart": start.isoformat(), "periodEnd": end.isoformat()}
        )
    return {"week": start.isoformat(), "users": len(users)}


__all__ = ["digest_fanout", "digest_weekly", "import_trades", "score_bias", "simulate_simple"]
