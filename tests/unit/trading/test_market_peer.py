"""The market-data peer through the real client over loopback HTTP: reproducible generated
candles, sub-windows, consistent OHLC, trading calendars, daily aggregates, the stylized
facts of returns (volatility clustering, fat tails), refusals, the client's errors and its
fallback from the primary to the vendor."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pytest

from conveyor.errors import PermanentError
from pipelines.trading.peers.market import ANCHOR, PRIMARY, VENDOR, MarketPeer, is_crypto
from tasks.trading.errors import PeerUnavailable, RateLimited
from tasks.trading.market import MarketClient, cache_key
from tasks.trading.series import Candle

START = datetime(2025, 3, 3, tzinfo=UTC)  # a Monday
WEEK = timedelta(days=7)


@pytest.fixture(scope="module")
def peer() -> Iterator[MarketPeer]:
    with MarketPeer() as running:
        yield running


@pytest.fixture
def market(peer: MarketPeer) -> Iterator[MarketClient]:
    peer.faults(clear=True)
    with MarketClient(peer.url) as client:
        yield client


def _log_returns(candles: list[Candle]) -> np.ndarray:
    return np.diff(np.log([c.c for c in candles]))


def _kurtosis(x: np.ndarray) -> float:
    centered = x - x.mean()
    return float((centered**4).mean() / (centered**2).mean() ** 2)


def _acf1(x: np.ndarray) -> float:
    return float(np.corrcoef(x[:-1], x[1:])[0, 1])


def test_the_same_request_returns_the_same_numbers_from_any_peer(market: MarketClient) -> None:
    first = market.ohlcv("BTC-USD", "1h", START, START + WEEK)
    assert market.ohlcv("BTC-USD", "1h", START, START + WEEK) == first
    with MarketPeer() as fresh, MarketClient(fresh.url) as other:
        assert other.ohlcv("BTC-USD", "1h", START, START + WEEK) == first
    with MarketPeer(seed=8) as reseeded, MarketClient(reseeded.url) as other:
        assert other.ohlcv("BTC-USD", "1h", START, START + WEEK) != first


def test_a_sub_window_returns_the_same_candles(market: MarketClient) -> None:
    whole = market.ohlcv("ETHUSDT", "1h", START, START + 3 * WEEK)
    part = market.ohlcv("ETHUSDT", "1h", START + timedelta(hours=37), START + 2 * WEEK + timedelta(hours=5))
    assert part == whole[37 : 14 * 24 + 5]
    days = market.ohlcv("ETHUSDT", "1d", START, START + 3 * WEEK)
    assert market.ohlcv("ETHUSDT", "1d", START + timedelta(days=4), START + timedelta(days=9)) == days[4:9]


def test_the_path_does_not_depend_on_which_window_was_asked_first() -> None:
    late = (datetime(2026, 6, 1, tzinfo=UTC), datetime(2026, 6, 3, tzinfo=UTC))
    early = (datetime(2020, 2, 1, tzinfo=UTC), datetime(2020, 2, 3, tzinfo=UTC))
    a, b = MarketPeer(), MarketPeer()
    now = datetime(2026, 11, 1, tzinfo=UTC)
    a_late, a_early = a.candles("SOL-USD", "1h", *late, now=now), a.candles("SOL-USD", "1h", *early, now=now)
    b_early, b_late = b.candles("SOL-USD", "1h", *early, now=now), b.candles("SOL-USD", "1h", *late, now=now)
    assert (a_late, a_early) == (b_late, b_early)


def test_from_is_inclusive_to_exclusive_and_candles_are_aligned(market: MarketClient) -> None:
    candles = market.ohlcv("BTC-USD", "1h", START + timedelta(minutes=30), START + timedelta(hours=5))
    assert [c.t for c in candles] == [START + timedelta(hours=h) for h in range(1, 5)]
    exact = market.ohlcv("BTC-USD", "1h", START, START + timedelta(hours=5))
    assert [c.t for c in exact] == [START + timedelta(hours=h) for h in range(5)]
    days = market.ohlcv("BTC-USD", "1d", START + timedelta(hours=1), START + timedelta(days=3))
    assert [c.t for c in days] == [START + timedelta(days=d) for d in (1, 2)]
    assert market.ohlcv("BTC-USD", "1h", START, START) == []


@pytest.mark.parametrize("symbol", ["BTC-USD", "ETHUSDT", "AAPL"])
def test_ohlc_is_consistent(market: MarketClient, symbol: str) -> None:
    for granularity in ("1h", "1d"):
        candles = market.ohlcv(symbol, granularity, START, START + 4 * WEEK)
        assert candles
        for previous, candle in itertools.pairwise(candles):
            assert candle.o == previous.c
            assert candle.t > previous.t
        for candle in candles:
            assert candle.h >= max(candle.o, candle.c) >= min(candle.o, candle.c) >= candle.l > 0
            assert candle.v > 0 and all(math.isfinite(x) for x in (candle.o, candle.h, candle.l, candle.c))


def test_price_scales_per_symbol(market: MarketClient) -> None:
    first_hour = (ANCHOR, ANCHOR + timedelta(hours=1))
    assert market.ohlcv("BTC-USD", "1h", *first_hour)[0].o == pytest.approx(40_000, rel=1e-6)
    assert market.ohlcv("ETHUSDT", "1h", *first_hour)[0].o == pytest.approx(2_500, rel=1e-6)
    assert 40 < market.ohlcv("MSFT", "1h", *first_hour)[0].o < 250
    recent = market.ohlcv("BTCUSDT", "1d", START, START + WEEK)
    assert all(8_000 < c.c < 200_000 for c in recent)


def test_stocks_have_no_candles_on_weekends(market: MarketClient) -> None:
    hours = market.ohlcv("AAPL", "1h", START, START + 2 * WEEK)
    assert {c.t.weekday() for c in hours} == {0, 1, 2, 3, 4}
    assert len(hours) == 10 * 24
    days = market.ohlcv("AAPL", "1d", START, START + 2 * WEEK)
    assert [c.t.weekday() for c in days] == [0, 1, 2, 3, 4] * 2
    assert not is_crypto("AAPL") and is_crypto("BTC-USD") and is_crypto("ETHUSDT") and is_crypto("ETHBTC")


def test_crypto_trades_every_hour_of_every_day(market: MarketClient) -> None:
    hours = market.ohlcv("BTC-USD", "1h", START, START + 2 * WEEK)
    assert [c.t for c in hours] == [START + timedelta(hours=h) for h in range(14 * 24)]
    days = market.ohlcv("BTC-USD", "1d", START, START + 2 * WEEK)
    assert len(days) == 14


def test_a_day_aggregates_its_hours(market: MarketClient) -> None:
    for symbol in ("BTC-USD", "AAPL"):
        hours = market.ohlcv(symbol, "1h", START, START + WEEK)
        for day in market.ohlcv(symbol, "1d", START, START + WEEK):
            its = [h for h in hours if day.t <= h.t < day.t + timedelta(days=1)]
            assert len(its) == 24
            assert (day.o, day.c) == (its[0].o, its[-1].c)
            assert day.h == max(h.h for h in its) and day.l == min(h.l for h in its)
            assert day.v == pytest.approx(sum(h.v for h in its))


def test_hourly_returns_cluster_in_volatility_and_have_fat_tails(market: MarketClient) -> None:
    start = datetime(2022, 1, 1, tzinfo=UTC)
    for symbol in ("BTC-USD", "AAPL"):
        candles = market.ohlcv(symbol, "1h", start, start + timedelta(days=800))
        assert len(candles) > 13_000
        returns = _log_returns(candles)
        assert _acf1(returns**2) > 0.05, symbol
        assert _kurtosis(returns) > 3, symbol
        assert abs(_acf1(returns)) < 0.05, symbol  # clustered volatility, not predictable returns
        # Volume tracks the size of the move.
        moves = np.abs(np.log([c.c / c.o for c in candles]))
        assert np.corrcoef(moves, [c.v for c in candles])[0, 1] > 0.3


def test_daily_returns_look_like_the_sp500s_when_arch_is_installed(market: MarketClient) -> None:
    arch_data = pytest.importorskip("arch.data.sp500")
    sp500 = arch_data.load()["Adj Close"].to_numpy()
    real = np.diff(np.log(sp500))
    ours = _log_returns(market.ohlcv("SPY", "1d", ANCHOR, ANCHOR + timedelta(days=2300)))
    for returns in (real, ours):
        assert _kurtosis(returns) > 3
        assert _acf1(returns**2) > 0.05
    # Same order of magnitude of daily volatility as the index.
    assert 0.3 < ours.std() / real.std() < 3


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ({"granularity": "5m"}, 400),
        ({"from": "yesterday"}, 400),
        ({"to": ""}, 400),
        ({"symbol": ""}, 400),
        ({"symbol": "BTC USD!"}, 400),
        ({"from": "2025-03-10T00:00:00Z", "to": "2025-03-03T00:00:00Z"}, 400),
        ({"from": "2019-12-31T23:00:00Z"}, 422),
        ({"to": (datetime.now(UTC) + timedelta(days=401)).isoformat()}, 422),
        ({"from": "2022-01-01T00:00:00Z", "to": "2024-06-01T00:00:00Z"}, 422),  # > 20 000 hours
    ],
)
def test_bad_requests_are_refused(peer: MarketPeer, query: dict[str, str], status: int) -> None:
    params = {
        "symbol": "BTC-USD",
        "granularity": "1h",
        "from": "2025-03-03T00:00:00Z",
        "to": "2025-03-04T00:00:00Z",
    }
    response = httpx.get(f"{peer.url}/v1/ohlcv", params={**params, **query})
    assert response.status_code == status
    assert isinstance(response.json()["error"], str)


def test_a_long_daily_window_is_fine(market: MarketClient) -> None:
    days = market.ohlcv("BTC-USD", "1d", ANCHOR, ANCHOR + timedelta(days=2000))
    assert len(days) == 2000


def test_the_client_turns_a_refusal_into_a_permanent_error(market: MarketClient) -> None:
    with pytest.raises(PermanentError, match=r"BTC-USD 1h .*HTTP 422.*before"):
        market.ohlcv("BTC-USD", "1h", ANCHOR - timedelta(hours=1), ANCHOR + timedelta(hours=1))
    with pytest.raises(ValueError):
        market.ohlcv("BTC-USD", "15m", START, START + WEEK)


def test_the_vendor_route_serves_the_same(peer: MarketPeer, market: MarketClient) -> None:
    params = {
        "symbol": "AAPL",
        "granularity": "1h",
        "from": "2025-03-03T00:00:00Z",
        "to": "2025-03-04T00:00:00Z",
    }
    vendor = httpx.get(f"{peer.url}/v1/vendor/ohlcv", params=params).json()
    assert vendor["symbol"] == "AAPL" and vendor["granularity"] == "1h"
    assert [Candle.from_json(c) for c in vendor["candles"]] == market.ohlcv(
        "AAPL", "1h", START, START + timedelta(days=1)
    )


def test_preload_asks_once_per_distinct_symbol(peer: MarketPeer, market: MarketClient) -> None:
    before = peer.stats()["requests"].get("/v1/ohlcv", 0)
    loaded = market.preload(["BTC-USD", "AAPL", "BTC-USD", "ETHUSDT"], "1h", START, START + timedelta(days=2))
    assert list(loaded) == ["BTC-USD", "AAPL", "ETHUSDT"]
    assert loaded["BTC-USD"] == market.ohlcv("BTC-USD", "1h", START, START + timedelta(days=2))
    assert peer.stats()["requests"]["/v1/ohlcv"] == before + 4


def test_a_429_is_rate_limited_with_its_retry_after(peer: MarketPeer, market: MarketClient) -> None:
    peer.faults(storm=1, retry_after_s=2.5)
    with pytest.raises(RateLimited) as caught:
        market.ohlcv("BTC-USD", "1h", START, START + WEEK)
    # A primary's 429 is its answer (no fallback): the broker's market data asks us to wait.
    assert (caught.value.retry_after, caught.value.source) == (2.5, "broker")
    assert market.ohlcv("BTC-USD", "1h", START, START + WEEK)


def test_5xx_slow_and_unreachable_peers_are_unavailable(peer: MarketPeer, market: MarketClient) -> None:
    peer.faults(fail_5xx=2)  # the primary's and the vendor's
    with pytest.raises(PeerUnavailable, match=r"primary answered HTTP 503; .* vendor answered HTTP 503"):
        market.ohlcv("BTC-USD", "1h", START, START + WEEK)
    peer.faults(clear=True, latency_ms=800)
    with MarketClient(peer.url, timeout=0.2) as hasty, pytest.raises(PeerUnavailable, match="timed out"):
        hasty.ohlcv("BTC-USD", "1h", START, START + WEEK)
    peer.faults(clear=True)
    stopped = MarketPeer().start()
    url = stopped.url
    stopped.stop()
    with MarketClient(url) as gone, pytest.raises(PeerUnavailable, match="could not be reached"):
        gone.ohlcv("BTC-USD", "1h", START, START + WEEK)


def _requests(peer: MarketPeer) -> tuple[int, int]:
    counts = peer.stats()["requests"]
    return counts.get(PRIMARY, 0), counts.get(VENDOR, 0)


def test_the_primary_answers_when_it_can(peer: MarketPeer, market: MarketClient) -> None:
    before = _requests(peer)
    candles, source = market.fetch("BTC-USD", "1h", START, START + timedelta(days=1))
    assert source == "primary" and len(candles) == 24
    assert _requests(peer) == (before[0] + 1, before[1])


def test_a_failing_primary_falls_back_to_the_vendor(peer: MarketPeer, market: MarketClient) -> None:
    expected = market.ohlcv("AAPL", "1h", START, START + WEEK)
    peer.faults(fail_primary=True)
    before = _requests(peer)
    for _ in range(2):  # fail_primary lasts until cleared
        assert market.fetch("AAPL", "1h", START, START + WEEK) == (expected, "vendor")
    assert _requests(peer) == (before[0] + 2, before[1] + 2)
    assert market.ohlcv("AAPL", "1h", START, START + WEEK) == expected
    peer.faults(fail_primary=False)
    assert market.fetch("AAPL", "1h", START, START + WEEK)[1] == "primary"
    # A one-shot 5xx falls back too.
    peer.faults(fail_5xx=1)
    assert market.fetch("AAPL", "1h", START, START + WEEK) == (expected, "vendor")


def test_a_slow_or_unreachable_primary_falls_back_to_the_vendor(peer: MarketPeer) -> None:
    peer.faults(clear=True)
    stopped = MarketPeer().start()
    url = stopped.url
    stopped.stop()
    with MarketClient(url, vendor_url=peer.url) as client:
        assert client.fetch("ETHUSDT", "1h", START, START + timedelta(hours=3))[1] == "vendor"
    with MarketPeer() as slow, MarketClient(slow.url, vendor_url=peer.url, timeout=0.3) as client:
        slow.faults(latency_ms=800)
        candles, source = client.fetch("ETHUSDT", "1h", START, START + timedelta(hours=3))
        assert source == "vendor" and len(candles) == 3


def test_a_primary_4xx_does_not_fall_back(peer: MarketPeer, market: MarketClient) -> None:
    before = _requests(peer)
    with pytest.raises(PermanentError, match="HTTP 422"):
        market.fetch("BTC-USD", "1h", ANCHOR - timedelta(hours=2), ANCHOR)
    peer.faults(storm=1)
    with pytest.raises(RateLimited):
        market.fetch("BTC-USD", "1h", START, START + WEEK)
    assert _requests(peer) == (before[0] + 2, before[1])


def test_a_vendor_429_is_rate_limited_and_counted(peer: MarketPeer) -> None:
    peer.faults(clear=True, fail_primary=True, vendor_429=2, retry_after_s=0.5)
    seen: list[str] = []
    with MarketClient(peer.url, on_429=seen.append) as client:
        for _ in range(2):
            with pytest.raises(RateLimited) as caught:
                client.fetch("BTC-USD", "1h", START, START + WEEK)
            assert (caught.value.retry_after, caught.value.source) == (0.5, "vendor")
        assert client.fetch("BTC-USD", "1h", START, START + WEEK)[1] == "vendor"
        peer.faults(clear=True, storm=1)
        with pytest.raises(RateLimited):
            client.fetch("BTC-USD", "1h", START, START + WEEK)
    assert seen == ["vendor", "vendor", "broker"]
    assert peer.faults()["vendor_429"] == 0


def test_vendor_429_leaves_the_primary_alone(peer: MarketPeer, market: MarketClient) -> None:
    peer.faults(vendor_429=1)
    assert market.fetch("BTC-USD", "1h", START, START + WEEK)[1] == "primary"
    answer = httpx.get(
        f"{peer.url}{VENDOR}",
        params={"symbol": "BTC-USD", "granularity": "1h", "from": "2025-03-03T00:00:00Z", "to": "2025-03-04"},
    )
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "1"


def test_latency_slows_both_routes(peer: MarketPeer, market: MarketClient) -> None:
    peer.faults(latency_ms=150, fail_primary=True)
    started = time.monotonic()
    assert market.fetch("BTC-USD", "1h", START, START + timedelta(hours=2))[1] == "vendor"
    assert time.monotonic() - started >= 0.3


def test_a_window_is_asked_on_the_hour(peer: MarketPeer, market: MarketClient) -> None:
    ragged = market.fetch(
        "BTC-USD", "1h", START + timedelta(minutes=1), START + timedelta(hours=4, seconds=5)
    )
    assert [c.t for c in ragged[0]] == [START + timedelta(hours=h) for h in range(1, 5)]
    key = cache_key("p", "BTC-USD", "1h", START + timedelta(minutes=1), START + timedelta(hours=4, seconds=5))
    assert key == "p:BTC-USD:1h:2025-03-03T01:00:00Z:2025-03-03T05:00:00Z"
    assert (
        cache_key("p", "BTC-USD", "1d", START, START)
        == "p:BTC-USD:1d:2025-03-03T00:00:00Z:2025-03-03T00:00:00Z"
    )


def test_faults_over_http(peer: MarketPeer) -> None:
    answer = httpx.post(f"{peer.url}/_peer/faults", json={"latency_ms": 1}).json()
    assert answer["latency_ms"] == 1.0
    assert httpx.post(f"{peer.url}/_peer/faults", json={"down": True}).status_code == 400
    assert httpx.post(f"{peer.url}/_peer/faults", json={"fail_primary": 1}).status_code == 400
    assert httpx.post(f"{peer.url}/_peer/faults", json={"vendor_429": 1.5}).status_code == 400
    both = httpx.post(f"{peer.url}/_peer/faults", json={"fail_primary": True, "vendor_429": 3}).json()
    assert (both["fail_primary"], both["vendor_429"]) == (True, 3)
    cleared = httpx.post(f"{peer.url}/_peer/faults", json={"clear": True}).json()
    assert (cleared["latency_ms"], cleared["fail_primary"], cleared["vendor_429"]) == (0.0, False, 0)
