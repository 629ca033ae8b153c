"""The market-data client: OHLCV candles per symbol, the seed's path "broker → vendor"
(``GET /v1/ohlcv?symbol=&granularity=&from=&to=`` on the primary, the broker's market data;
``GET /v1/vendor/ohlcv`` with the same query on the fallback vendor), candles starting in
``[from, to)``, cached in Redis.

**Fallback.** The primary is asked first; when it answers 5xx, times out, cannot be reached
or answers something unreadable, the vendor is asked. A 4xx of the primary is its answer (no
fallback): a 429 raises :class:`RateLimited` with source ``broker`` (the primary is the
broker's market data; the sources are the labels of ``trading_vendor_429_total``), any other
4xx :class:`conveyor.errors.PermanentError` (a bad symbol, granularity or window). The
vendor's outcomes are the same, its 429 with source ``vendor``; when both are unavailable,
:class:`PeerUnavailable` names both reasons. Every 429 seen is also told to ``on_429``
(its source), for the metric. No automatic retries, no sleeping: the stage decides.

**Cache.** With a ``cache`` (a ``redis.Redis``), each answer is stored under
``{cache_prefix}:{symbol}:{granularity}:{from}:{to}`` as JSON ``{"source", "candles"}`` for
``cache_ttl`` seconds (at most :data:`OPEN_WINDOW_TTL` for a window ending after now, whose
last candles may still change). ``from`` and ``to`` are the window's bounds rounded up to
the hour: candles start on the hour, so the rounded window holds exactly the same candles,
and every window within the same hours shares one entry. A hit makes no HTTP request. A
cache that fails (Redis down, a garbled entry) is skipped: the candles come from HTTP.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx

from conveyor.errors import PermanentError
from tasks.trading.broker import parse_retry_after
from tasks.trading.errors import PeerUnavailable, RateLimited
from tasks.trading.series import Candle
from tasks.trading.transport import http_client

if TYPE_CHECKING:
    import redis

__all__ = ["GRANULARITIES", "OPEN_WINDOW_TTL", "SOURCES", "MarketClient", "cache_key"]

GRANULARITIES = ("1h", "1d")
SOURCES = ("primary", "vendor")
OPEN_WINDOW_TTL = 60.0
PRIMARY_PATH, VENDOR_PATH = "/v1/ohlcv", "/v1/vendor/ohlcv"
_RATE_SOURCES = {"primary": "broker", "vendor": "vendor"}
_MAX_REASON = 120
_HOUR = timedelta(hours=1)

log = logging.getLogger(__name__)


class MarketClient:
    """A synchronous client of the primary market data at ``base_url`` and the fallback
    vendor at ``vendor_url`` (default: the same host, its ``/v1/vendor/ohlcv``); ``timeout``
    (seconds) bounds each request. ``cache``, ``cache_ttl`` and ``cache_prefix``: the Redis
    cache (see the module's docstring); ``on_429``: called with the source (``broker`` or
    ``vendor``) of every 429 seen. Close it, or use it as a context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        vendor_url: str | None = None,
        cache: redis.Redis | None = None,
        cache_ttl: float = 3600,
        cache_prefix: str = "trading:ohlcv",
        on_429: Callable[[str], None] | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._vendor_url = (vendor_url or base_url).rstrip("/")
        self._client = http_client(timeout)
        self._cache = cache
        self._cache_ttl = cache_ttl
        self._cache_prefix = cache_prefix
        self._on_429 = on_429

    def __repr__(self) -> str:
        return f"MarketClient({self._base_url}, vendor={self._vendor_url})"

    def fetch(
        self, symbol: str, granularity: str, start: datetime, end: datetime
    ) -> tuple[list[Candle], str]:
        """The candles of ``symbol`` at ``granularity`` (``1h`` or ``1d``) starting in
        ``[start, end)``, oldest first (naive datetimes are UTC), and the source that
        answered: ``primary`` or ``vendor`` (a cache hit gives the source it was stored
        from). Raises as the module's docstring says."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}")
        start, end = _ceil_hour(start), _ceil_hour(end)
        key = cache_key(self._cache_prefix, symbol, granularity, start, end)
        hit = self._cached(key)
        if hit is not None:
            return hit
        params = {"symbol": symbol, "granularity": granularity, "from": _iso(start), "to": _iso(end)}
        what = f"market data {symbol} {granularity}"
        try:
            candles, source = self._get(f"{self._base_url}{PRIMARY_PATH}", params, what, "primary"), "primary"
        except PeerUnavailable as primary:
            try:
                candles, source = (
                    self._get(f"{self._vendor_url}{VENDOR_PATH}", params, what, "vendor"),
                    "vendor",
                )
            except PeerUnavailable as vendor:
                raise PeerUnavailable(f"{primary}; {vendor}") from None
        self._store(key, candles, source, end)
        return candles, source

    def ohlcv(self, symbol: str, granularity: str, start: datetime, end: datetime) -> list[Candle]:
        """The candles of :meth:`fetch`, without the source."""
        return self.fetch(symbol, granularity, start, end)[0]

    def preload(
        self, symbols: Iterable[str], granularity: str, start: datetime, end: datetime
    ) -> dict[str, list[Candle]]:
        """:meth:`ohlcv` of each distinct symbol (one fetch each), by symbol."""
        return {symbol: self.ohlcv(symbol, granularity, start, end) for symbol in dict.fromkeys(symbols)}

    def close(self) -> None:
        """Close the connections (not the cache's: the caller owns it)."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- HTTP ---------------------------------------------------------------------------

    def _get(self, url: str, params: dict[str, str], what: str, source: str) -> list[Candle]:
        try:
            response = self._client.get(url, params=params)
        except httpx.TimeoutException as exc:
            raise PeerUnavailable(f"{what} {source} timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{what} {source} could not be reached ({type(exc).__name__})") from None
        status = response.status_code
        if status == 429:
            rate_source = _RATE_SOURCES[source]
            if self._on_429 is not None:
                self._on_429(rate_source)
            raise RateLimited(parse_retry_after(response.headers.get("Retry-After")), source=rate_source)
        if status >= 500:
            raise PeerUnavailable(f"{what} {source} answered HTTP {status}")
        if status != 200:
            raise PermanentError(f"{what} {source} refused the request (HTTP {status}: {_reason(response)})")
        return _candles(f"{what} {source}", response)

    # -- cache --------------------------------------------------------------------------

    def _cached(self, key: str) -> tuple[list[Candle], str] | None:
        if self._cache is None:
            return None
        try:
            raw = self._cache.get(key)
        except Exception as exc:  # a cache that fails is skipped, whatever the client raises
            log.warning("market data cache unavailable (%s); fetching over HTTP", type(exc).__name__)
            return None
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            source = body["source"]
            if source not in SOURCES:
                raise ValueError("unknown source")
            return [Candle.from_json(item) for item in body["candles"]], source
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("market data cache entry %s is unreadable; fetching over HTTP", key)
            return None

    def _store(self, key: str, candles: list[Candle], source: str, end: datetime) -> None:
        if self._cache is None:
            return
        ttl = self._cache_ttl if end <= datetime.now(UTC) else min(self._cache_ttl, OPEN_WINDOW_TTL)
        value = json.dumps({"source": source, "candles": [c.to_json() for c in candles]})
        try:
            self._cache.set(key, value, px=max(1, int(ttl * 1000)))
        except Exception as exc:  # as in _cached: the candles are fetched, the cache is optional
            log.warning("market data cache unavailable (%s); not cached", type(exc).__name__)


def cache_key(prefix: str, symbol: str, granularity: str, start: datetime, end: datetime) -> str:
    """The cache key of a window: ``{prefix}:{symbol}:{granularity}:{from}:{to}``, the bounds
    rounded up to the hour (the same candles) in ISO-8601 UTC."""
    return f"{prefix}:{symbol}:{granularity}:{_iso(_ceil_hour(start))}:{_iso(_ceil_hour(end))}"


def _candles(what: str, response: httpx.Response) -> list[Candle]:
    try:
        body: Any = response.json()
    except ValueError:
        raise PeerUnavailable(f"{what} answered a body that is not JSON") from None
    items = body.get("candles") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise PeerUnavailable(f"{what} answered without a candles list")
    candles = []
    for index, item in enumerate(items):
        try:
            candles.append(Candle.from_json(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PeerUnavailable(f"{what} answered a malformed candle at {index}") from None
    return sorted(candles, key=lambda candle: candle.t)


def _reason(response: httpx.Response) -> str:
    try:
        reason = response.json().get("error")
    except (ValueError, AttributeError):
        return "no reason given"
    return reason[:_MAX_REASON] if isinstance(reason, str) and reason else "no reason given"


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _ceil_hour(moment: datetime) -> datetime:
    moment = _utc(moment)
    floor = moment.replace(minute=0, second=0, microsecond=0)
    return floor if floor == moment else floor + _HOUR


def _iso(moment: datetime) -> str:
    return _utc(moment).isoformat().replace("+00:00", "Z")
