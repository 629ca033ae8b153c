"""What the trading family's tests share: the peers, the platform's ``CONVEYOR_TRADING``
pointed at them, a connected user with sample trades, and reading rows and events."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select

from conveyor.store.db.schema import job_events
from pipelines.trading.jobs import connect_broker
from pipelines.trading.peers import TradingPeers
from pipelines.trading.peers.broker import sample_trades
from tasks.trading import tables as t
from tasks.trading.settings import TradingSettings

KEY_ID = "test-key"
SECRET = "hmac-canary-5f1c0e9a7b"
# One key for the test process and its worker subprocesses (tokens stored by one are read
# by the other); a test key, never a deployment's.
TOKEN_KEY = "mJ0S9fN9b3GxvHqzM1x8kq2mV4WcQ5w0bQy7tXr8QjI="


def trading_config(peers: TradingPeers, **changes: Any) -> dict[str, Any]:
    """``CONVEYOR_TRADING`` for ``peers`` (as a JSON-ready dict)."""
    return {
        "broker_urls": {"coinbase": peers.broker.url, "binance": peers.broker.url},
        "market_url": peers.market.url,
        "ai_url": peers.coach.url,
        "ai_key_id": KEY_ID,
        "ai_secret": SECRET,
        "rate_limit_safety_ms": 50,
        "token_key": TOKEN_KEY,
        **changes,
    }


@contextmanager
def trading_settings(platform: Any, peers: TradingPeers, **changes: Any) -> Iterator[TradingSettings]:
    """The platform's ``CONVEYOR_TRADING`` pointed at ``peers`` for the block (the stages
    read it at each job)."""
    before = platform.settings.trading
    chosen = TradingSettings.model_validate(trading_config(peers, **changes))
    platform.settings.trading = chosen
    try:
        yield chosen
    finally:
        platform.settings.trading = before


def started_peers() -> TradingPeers:
    """The three peers, the coach keyed by :data:`KEY_ID`/:data:`SECRET`."""
    return TradingPeers(ai_key_id=KEY_ID, ai_secret=SECRET).start()


def days_ago(n: int) -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(days=n)


def connected_user(
    platform: Any,
    peers: TradingPeers,
    user: str,
    *,
    n: int = 60,
    broker: str = "coinbase",
    rows: Any = None,
    owner: str | None = None,
) -> tuple[str, list[Any]]:
    """``user`` connected to ``broker`` (by ``owner``'s token, else the deployment) with
    ``n`` sample trades from 20 days ago (or ``rows``); returns the token and the rows the
    broker serves."""
    token = f"tok-{user}-canary"
    served = (
        rows if rows is not None else sample_trades(broker, n, start=days_ago(20), seed=hash(user) % 1000)
    )
    peers.broker.set_user(user, broker, token, served)
    connect_broker(platform, user, broker, token, owner=owner)
    return token, served


def count(platform: Any, table: Any, user: str) -> int:
    with platform.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.user_id == user)
        return int(conn.execute(query).scalar_one())


def trades(platform: Any, user: str) -> list[Any]:
    with platform.engine.connect() as conn:
        query = select(t.trades).where(t.trades.c.user_id == user).order_by(t.trades.c.ts)
        return list(conn.execute(query).mappings())


def events(platform: Any, job_id: str, topic: str) -> list[dict[str, Any]]:
    with platform.engine.connect() as conn:
        query = (
            select(job_events.c.body)
            .where(job_events.c.job_id == job_id, job_events.c.topic == topic)
            .order_by(job_events.c.id)
        )
        return [dict(b) for b in conn.execute(query).scalars()]


def reflect_events(platform: Any, user: str) -> list[dict[str, Any]]:
    """Every ``coach.reflect`` event of the user's score jobs, in commit order."""
    with platform.engine.connect() as conn:
        scores = select(t.scores.c.job_id).where(t.scores.c.user_id == user)
        query = (
            select(job_events.c.body)
            .where(job_events.c.topic == "coach.reflect", job_events.c.job_id.in_(scores))
            .order_by(job_events.c.id)
        )
        return [dict(b) for b in conn.execute(query).scalars()]
