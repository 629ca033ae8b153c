"""The market-data client's Redis cache on the platform's real Redis, against the market
peer over loopback HTTP: a window fetched once is served from Redis (no request), the source
that answered is cached with it, the fallback to the vendor and a vendor's 429 pass through
the cache, and a Redis that is down is skipped (the candles come from HTTP)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from pipelines.email.peers import free_port
from pipelines.trading.peers.market import PRIMARY, VENDOR, MarketPeer
from tasks.trading.errors import RateLimited
from tasks.trading.market import MarketClient, cache_key

pytestmark = pytest.mark.timeout(60)
START = datetime(2025, 3, 3, tzinfo=UTC)
END = START + timedelta(days=2)


@pytest.fixture(scope="module")
def peer() -> Iterator[MarketPeer]:
    with MarketPeer() as running:
        yield running


@pytest.fixture
def prefix(platform: Any, tag: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are removed after."""
    prefix = f"{tag}:ohlcv"
    yield prefix
    keys = list(platform.redis.scan_iter(f"{prefix}:*"))
    if keys:
        platform.redis.delete(*keys)


def requests(peer: MarketPeer) -> tuple[int, int]:
    counts = peer.stats()["requests"]
    return counts.get(PRIMARY, 0), counts.get(VENDOR, 0)


def test_a_second_fetch_of_a_window_makes_no_request(platform: Any, peer: MarketPeer, prefix: str) -> None:
    peer.faults(clear=True)
    with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix) as client:
        before = requests(peer)
        candles, source = client.fetch("BTC-USD", "1h", START, END)
        assert source == "primary" and len(candles) == 48
        assert requests(peer) == (before[0] + 1, before[1])
        # The same window, and the same hours asked off the hour: served from Redis.
        assert client.fetch("BTC-USD", "1h", START, END) == (candles, "primary")
        ragged = client.ohlcv("BTC-USD", "1h", START - timedelta(minutes=20), END - timedelta(minutes=5))
        assert ragged == candles
        assert client.preload(["BTC-USD"], "1h", START, END) == {"BTC-USD": candles}
        assert requests(peer) == (before[0] + 1, before[1])
        # Another window, symbol or granularity is another entry.
        client.ohlcv("BTC-USD", "1h", START, END + timedelta(hours=1))
        client.ohlcv("ETHUSDT", "1h", START, END)
        client.ohlcv("BTC-USD", "1d", START, END)
        assert requests(peer) == (before[0] + 4, before[1])
    stored = json.loads(platform.redis.get(cache_key(prefix, "BTC-USD", "1h", START, END)))
    assert stored["source"] == "primary" and len(stored["candles"]) == 48
    ttl = platform.redis.pttl(cache_key(prefix, "BTC-USD", "1h", START, END))
    assert 3_590_000 < ttl <= 3_600_000
    # Another client on the same Redis shares the entry.
    with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix) as other:
        assert other.fetch("BTC-USD", "1h", START, END) == (candles, "primary")
    assert requests(peer) == (before[0] + 4, before[1])


def test_a_window_reaching_past_now_is_cached_briefly(platform: Any, peer: MarketPeer, prefix: str) -> None:
    peer.faults(clear=True)
    now = datetime.now(UTC)
    with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix, cache_ttl=600) as client:
        client.fetch("BTC-USD", "1h", now - timedelta(hours=5), now + timedelta(hours=1))
        client.fetch("BTC-USD", "1h", now - timedelta(days=3), now - timedelta(days=2))
    assert (
        0
        < platform.redis.pttl(
            cache_key(prefix, "BTC-USD", "1h", now - timedelta(hours=5), now + timedelta(hours=1))
        )
        <= 60_000
    )
    assert (
        590_000
        < platform.redis.pttl(
            cache_key(prefix, "BTC-USD", "1h", now - timedelta(days=3), now - timedelta(days=2))
        )
        <= 600_000
    )


def test_a_failing_primary_is_answered_by_the_vendor_and_cached_so(
    platform: Any, peer: MarketPeer, prefix: str
) -> None:
    peer.faults(clear=True, fail_primary=True)
    try:
        with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix) as client:
            before = requests(peer)
            candles, source = client.fetch("AAPL", "1h", START, END)
            assert source == "vendor" and len(candles) == 48
            assert requests(peer) == (before[0] + 1, before[1] + 1)
            peer.faults(fail_primary=False)
            # A hit keeps the source that answered (the sim's result key carries it).
            assert client.fetch("AAPL", "1h", START, END) == (candles, "vendor")
            assert requests(peer) == (before[0] + 1, before[1] + 1)
    finally:
        peer.faults(clear=True)


def test_a_vendor_429_is_rate_limited_and_nothing_is_cached(
    platform: Any, peer: MarketPeer, prefix: str
) -> None:
    peer.faults(clear=True, fail_primary=True, vendor_429=1, retry_after_s=0.25)
    seen: list[str] = []
    try:
        with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix, on_429=seen.append) as client:
            with pytest.raises(RateLimited) as caught:
                client.fetch("SOL-USD", "1h", START, END)
            assert (caught.value.source, caught.value.retry_after) == ("vendor", 0.25)
            assert platform.redis.get(cache_key(prefix, "SOL-USD", "1h", START, END)) is None
            assert client.fetch("SOL-USD", "1h", START, END)[1] == "vendor"
    finally:
        peer.faults(clear=True)
    assert seen == ["vendor"]


def test_a_redis_that_is_down_is_skipped(peer: MarketPeer) -> None:
    peer.faults(clear=True)
    down = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    with MarketClient(peer.url, cache=down, cache_prefix="nowhere") as client:
        before = requests(peer)
        first = client.fetch("BTC-USD", "1h", START, END)
        assert first[1] == "primary" and len(first[0]) == 48
        assert client.fetch("BTC-USD", "1h", START, END) == first  # fetched again: no cache
        assert requests(peer) == (before[0] + 2, before[1])
    down.close()


def test_a_garbled_entry_is_refetched(platform: Any, peer: MarketPeer, prefix: str) -> None:
    peer.faults(clear=True)
    key = cache_key(prefix, "BTC-USD", "1h", START, END)
    platform.redis.set(key, b"{not json")
    with MarketClient(peer.url, cache=platform.redis, cache_prefix=prefix) as client:
        before = requests(peer)
        candles, source = client.fetch("BTC-USD", "1h", START, END)
        assert source == "primary" and len(candles) == 48
        assert requests(peer) == (before[0] + 1, before[1])
    assert json.loads(platform.redis.get(key))["source"] == "primary"  # replaced by the good answer
