"""``simulate.simple``: hold vs. actual after one trade (the model is
:mod:`tasks.trading.simulation`'s), with the seed's result cache and vendor back-off.

The result is cached in the platform's Redis under
``<prefix>trading:sim:{userId}:{tradeId}:{horizonDays}:{source}`` (``<prefix>``: the
deployment's ``key_prefix``) for ``sim_cache_ttl`` (1 h), where
``source`` is the market data that answered (``primary``, ``vendor``): a hit returns it
(``cached: true``) without reading anything else. On a miss the trade's hourly OHLCV from its
time to time + horizon comes from the market-data client (primary, then vendor; its own
Redis cache per window). A horizon running past now is cut at now (``partial: true``, the
``end`` used). A 429 waits 1 s, then 5 s (the seed's linear back-off; a shorter
``Retry-After`` wins), at most twice; then the body returns a cached result if one exists,
else a partial one with the points it has and a ``reason``. Market data unavailable (both
sources down) is an ordinary transient failure, retried on the stage's schedule; on the
job's last attempt the body answers the same way instead of failing: nothing a vendor does
dead-letters a sim.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, select

from conveyor.errors import SkipJob
from tasks.trading import tables as t
from tasks.trading.errors import PeerUnavailable, RateLimited
from tasks.trading.market import SOURCES, MarketClient
from tasks.trading.series import Candle
from tasks.trading.simulation import simulate

WAITS = (1.0, 5.0)  # the seed's "2 retries, linear (1s, 5s)"
log = logging.getLogger(__name__)


def cache_key(prefix: str, user_id: str, trade_id: str, horizon: int, source: str) -> str:
    """The result cache's key (the seed's ``sim:{userId}:{tradeId}:{horizonDays}``, by source)."""
    return f"{prefix}trading:sim:{user_id}:{trade_id}:{horizon}:{source}"


def cached(redis: Any, prefix: str, user_id: str, trade_id: str, horizon: int) -> dict[str, Any] | None:
    """A cached result of any source, marked ``cached``; None on a miss or a Redis error."""
    for source in SOURCES:
        try:
            raw = redis.get(cache_key(prefix, user_id, trade_id, horizon, source))
        except Exception:  # the cache is an optimisation: never the sim's failure
            log.warning("sim result cache unreadable; computing", exc_info=True)
            return None
        if raw:
            try:
                return {**json.loads(raw), "cached": True}
            except ValueError:
                continue
    return None


def trade_of(conn: Connection, user_id: str, trade_id: str) -> Any:
    """The user's stored trade, else :class:`SkipJob` "trade not found" (never whose)."""
    row = (
        conn.execute(select(t.trades).where(t.trades.c.id == trade_id, t.trades.c.user_id == user_id))
        .mappings()
        .first()
    )
    if row is None:
        raise SkipJob("trade not found", {"tradeId": trade_id, "found": False})
    return row


class Simulator:
    """Computes one sim; ``sleep`` is the body's wait between 429s (a parameter for tests)."""

    def __init__(
        self, market: MarketClient, redis: Any, *, prefix: str, ttl: float, sleep: Any = time.sleep
    ) -> None:
        self.market = market
        self.redis = redis
        self.prefix = prefix
        self.ttl = ttl
        self.sleep = sleep

    def run(
        self, user_id: str, horizon: int, trade: Mapping[str, Any], now: dt.datetime, *, final: bool = False
    ) -> dict[str, Any]:
        """The sim's result (cached in Redis when complete). ``final``: the job's last
        attempt, which answers partially when the market data is unavailable."""
        ts: dt.datetime = trade["ts"]
        end = ts + dt.timedelta(days=horizon)
        cut = end > now
        end_used = min(end, now)
        start = ts.replace(minute=0, second=0, microsecond=0)
        try:
            fetched = self._candles(str(trade["symbol"]), start, end_used)
            reason = "market data kept answering 429; the points it had"
        except PeerUnavailable as exc:
            if not final:
                raise
            fetched, reason = None, f"market data unavailable ({exc}); the points it had"
        if fetched is None:
            again = cached(self.redis, self.prefix, user_id, str(trade["id"]), horizon)
            if again is not None:
                return again
            out = self._curves(trade, [], end_used)
            return {**out, "source": None, "cached": False, "partial": True, "reason": reason[:300]}
        candles, source = fetched
        out = self._curves(trade, candles, end_used)
        result = {**out, "source": source, "cached": False, "partial": bool(out["partial"] or cut)}
        if not cut:
            try:
                key = cache_key(self.prefix, user_id, str(trade["id"]), horizon, source)
                self.redis.set(key, json.dumps(result), ex=int(self.ttl))
            except Exception:
                log.warning("sim result not cached", exc_info=True)
        return result

    def _candles(self, symbol: str, start: dt.datetime, end: dt.datetime) -> tuple[list[Candle], str] | None:
        for i in range(len(WAITS) + 1):
            try:
                return self.market.fetch(symbol, "1h", start, end)
            except RateLimited as limited:
                if i == len(WAITS):
                    return None
                wait = min(WAITS[i], limited.retry_after) if limited.retry_after > 0 else WAITS[i]
                log.info("market data 429 (%s); waiting %.2fs", limited.source, wait)
                self.sleep(wait)
        return None

    @staticmethod
    def _curves(trade: Mapping[str, Any], candles: list[Candle], end: dt.datetime) -> dict[str, Any]:
        return simulate(
            str(trade["side"]),
            float(trade["qty"]),
            float(trade["price"]),
            float(trade["fee"]),
            trade["ts"],
            candles,
            end=end,
        )


__all__ = ["WAITS", "Simulator", "cache_key", "cached", "trade_of"]
