"""The broker peer driven over real HTTP by the broker client: pages and cursors, the since
filter, 401s, rate limits and storms, garbage pages, the request log, a peer that is down."""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from pipelines.trading.peers.broker import BrokerPeer, sample_trades
from tasks.trading.broker import BrokerClient, Page, parse_retry_after
from tasks.trading.errors import (
    BrokerUnauthorized,
    PeerUnavailable,
    RateLimited,
    UnreadablePage,
)

TOKEN = "tok-SECRET-cb-7f3a"
START = datetime(2026, 10, 1, tzinfo=UTC)
SINCE = date(2026, 9, 1)


@pytest.fixture
def peer() -> Iterator[BrokerPeer]:
    with BrokerPeer() as running:
        yield running


@pytest.fixture
def client(peer: BrokerPeer) -> Iterator[BrokerClient]:
    with BrokerClient(peer.url, timeout=2.0) as broker_client:
        yield broker_client


def _traverse(client: BrokerClient, broker: str, token: str, since: date) -> list[Page]:
    pages: list[Page] = []
    cursor: str | None = None
    while True:
        page = client.fetch_page(broker, token, since, cursor, number=len(pages) + 1)
        pages.append(page)
        if page.next is None:
            return pages
        cursor = page.next


def test_paging_120_rows_in_pages_of_50(peer: BrokerPeer, client: BrokerClient) -> None:
    rows = sample_trades("coinbase", 120, start=START, seed=1)
    peer.set_user("u1", "coinbase", TOKEN, rows)
    pages = _traverse(client, "coinbase", TOKEN, SINCE)
    assert [len(p.rows) for p in pages] == [50, 50, 20]
    assert [p.number for p in pages] == [1, 2, 3]
    assert [row for p in pages for row in p.rows] == rows
    assert [p.percent for p in pages] == pytest.approx([41.67, 83.33, 100.0], abs=0.01)
    assert all(p.remaining == 1000 and p.reset_s == 0.0 for p in pages)
    # Stable cursors: the same cursor gives the same page.
    again = client.fetch_page("coinbase", TOKEN, SINCE, pages[0].next, number=2)
    assert again.rows == pages[1].rows and again.next == pages[1].next


def test_page_size_fault_and_empty_history(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "binance", TOKEN, sample_trades("binance", 7, start=START))
    peer.faults(page_size=3)
    assert [len(p.rows) for p in _traverse(client, "binance", TOKEN, SINCE)] == [3, 3, 1]
    peer.set_user("u1", "binance", TOKEN, [])
    (only,) = _traverse(client, "binance", TOKEN, SINCE)
    assert only.rows == [] and only.next is None and only.percent == 100.0


def test_since_filters_timed_rows_and_serves_malformed_ones(peer: BrokerPeer, client: BrokerClient) -> None:
    old = sample_trades("coinbase", 5, start=datetime(2026, 8, 1, tzinfo=UTC), seed=2)
    new = sample_trades("coinbase", 5, start=START, seed=3)
    malformed: list[Any] = [
        {"trade_id": "bad-time", "created_at": "not a time", "price": "1"},
        "not an object",
        None,
        {"trade_id": "no-time"},
    ]
    peer.set_user("u1", "coinbase", TOKEN, [*old, malformed[0], *new, *malformed[1:]])
    served = [r for p in _traverse(client, "coinbase", TOKEN, SINCE) for r in p.rows]
    assert served == [malformed[0], *new, *malformed[1:]]

    binance = sample_trades("binance", 4, start=datetime(2026, 8, 31, 22, tzinfo=UTC), seed=4)
    peer.set_user("u2", "binance", "tok-bn", binance)
    cutoff = datetime(2026, 9, 1, tzinfo=UTC).timestamp() * 1000
    served = [r for p in _traverse(client, "binance", "tok-bn", SINCE) for r in p.rows]
    assert served == [r for r in binance if r["time"] >= cutoff]


def test_unknown_or_other_brokers_token_is_401(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 3, start=START))
    with pytest.raises(BrokerUnauthorized) as wrong:
        client.fetch_page("coinbase", "tok-wrong-9999", SINCE, None, number=1)
    assert str(wrong.value) == "coinbase refused the token (HTTP 401)"
    with pytest.raises(BrokerUnauthorized) as other:
        client.fetch_page("binance", TOKEN, SINCE, None, number=1)
    assert TOKEN not in str(other.value) and "binance" in str(other.value)
    raw = httpx.get(f"{peer.url}/v1/coinbase/trades", headers={"Authorization": "Bearer nope"})
    assert raw.status_code == 401 and "error" in raw.json()
    # A new token replaces the user's old one.
    peer.set_user("u1", "coinbase", "tok-rotated", [])
    with pytest.raises(BrokerUnauthorized):
        client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)


def test_storm_raises_rate_limited_with_its_retry_after(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 3, start=START))
    peer.faults(storm=2, retry_after_s=0.35)
    for _ in range(2):
        with pytest.raises(RateLimited) as limited:
            client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
        assert limited.value.retry_after == pytest.approx(0.35)
        assert limited.value.source == "broker"
    assert len(client.fetch_page("coinbase", TOKEN, SINCE, None, number=1).rows) == 3
    assert [e["status"] for e in peer.log()] == [429, 429, 200]


def test_rate_per_s_counts_down_then_429(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 3, start=START))
    peer.faults(rate_per_s=3)
    remaining = [client.fetch_page("coinbase", TOKEN, SINCE, None, number=1).remaining for _ in range(3)]
    assert remaining == [2, 1, 0]
    with pytest.raises(RateLimited) as limited:
        client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
    assert 0.0 < limited.value.retry_after <= 1.0
    time.sleep(limited.value.retry_after + 0.02)
    page = client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
    assert page.remaining == 2 and page.reset_s is not None and 0.0 < page.reset_s <= 1.0


def test_garbage_page_is_unreadable_every_time(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 120, start=START))
    peer.faults(garbage_page=2)
    first = client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
    for _ in range(2):
        with pytest.raises(UnreadablePage) as unreadable:
            client.fetch_page("coinbase", TOKEN, SINCE, first.next, number=2)
        assert "coinbase page 2 is not readable JSON" in str(unreadable.value)
    peer.faults(clear=True)
    assert len(client.fetch_page("coinbase", TOKEN, SINCE, first.next, number=2).rows) == 50


def test_log_records_each_page_once(peer: BrokerPeer, client: BrokerClient) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 120, start=START))
    pages = _traverse(client, "coinbase", TOKEN, SINCE)
    log = peer.log()
    assert [(e["user"], e["broker"], e["page"], e["status"]) for e in log] == [
        ("u1", "coinbase", 1, 200),
        ("u1", "coinbase", 2, 200),
        ("u1", "coinbase", 3, 200),
    ]
    assert [e["cursor"] for e in log] == [None, pages[0].next, pages[1].next]
    assert httpx.get(f"{peer.url}/_peer/log").json() == log
    assert httpx.delete(f"{peer.url}/_peer/log").status_code == 200
    assert peer.log() == []


def test_control_routes_over_http(peer: BrokerPeer, client: BrokerClient) -> None:
    rows = [*sample_trades("binance", 3, start=START), 42, {"id": 1}]
    put = httpx.put(f"{peer.url}/_peer/users/u.9", json={"broker": "binance", "token": "t9", "trades": rows})
    assert put.status_code == 200 and put.json()["rows"] == 5
    assert httpx.post(f"{peer.url}/_peer/faults", json={"page_size": 2}).json()["page_size"] == 2
    assert [len(p.rows) for p in _traverse(client, "binance", "t9", SINCE)] == [2, 2, 1]
    assert httpx.post(f"{peer.url}/_peer/faults", json={"clear": True}).json()["page_size"] == 50
    assert httpx.post(f"{peer.url}/_peer/faults", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{peer.url}/_peer/faults", json={"page_size": 0}).status_code == 400
    bad = httpx.put(f"{peer.url}/_peer/users/u", json={"broker": "kraken", "token": "t", "trades": []})
    assert bad.status_code == 400
    assert (
        httpx.get(
            f"{peer.url}/v1/binance/trades?cursor=%%%", headers={"Authorization": "Bearer t9"}
        ).status_code
        == 400
    )


def test_down_peer_and_timeouts_are_peer_unavailable(peer: BrokerPeer) -> None:
    peer.set_user("u1", "coinbase", TOKEN, sample_trades("coinbase", 3, start=START))
    peer.faults(latency_ms=400)
    with BrokerClient(peer.url, timeout=0.1) as impatient, pytest.raises(PeerUnavailable) as slow:
        impatient.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
    assert "coinbase" in str(slow.value) and "timed out" in str(slow.value)
    url = peer.url
    peer.stop()
    with BrokerClient(url, timeout=1.0) as client, pytest.raises(PeerUnavailable) as down:
        client.fetch_page("coinbase", TOKEN, SINCE, None, number=1)
    assert "coinbase" in str(down.value) and TOKEN not in str(down.value)


def test_sample_trades_are_well_formed_and_reproducible() -> None:
    for broker, symbols in (
        ("coinbase", {"BTC-USD", "ETH-USD", "SOL-USD"}),
        ("binance", {"BTCUSDT", "ETHUSDT"}),
    ):
        rows = sample_trades(broker, 200, start=START, seed=5)
        assert rows == sample_trades(broker, 200, start=START, seed=5)
        assert rows != sample_trades(broker, 200, start=START, seed=6)
        if broker == "coinbase":
            times = [datetime.fromisoformat(r["created_at"].replace("Z", "+00:00")) for r in rows]
            assert {r["product_id"] for r in rows} <= symbols and {r["side"] for r in rows} == {"buy", "sell"}
            assert len({r["trade_id"] for r in rows}) == 200
            assert all(float(r["size"]) > 0 and float(r["price"]) > 0 and float(r["fee"]) >= 0 for r in rows)
            btc = [float(r["price"]) for r in rows if r["product_id"] == "BTC-USD"]
            assert all(20_000 < p < 90_000 for p in btc)
        else:
            times = [datetime.fromtimestamp(r["time"] / 1000, UTC) for r in rows]
            assert {r["symbol"] for r in rows} <= symbols and {r["isBuyer"] for r in rows} == {True, False}
            assert len({r["id"] for r in rows}) == 200
            assert all(float(r["qty"]) > 0 and float(r["price"]) > 0 for r in rows)
        assert times[0] > START and all(a < b for a, b in itertools.pairwise(times))


def test_parse_retry_after() -> None:
    assert parse_retry_after("0.35") == pytest.approx(0.35)
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(None) == 1.0
    assert parse_retry_after("soon") == 1.0
    assert parse_retry_after("-3") == 0.0
    now = datetime(2026, 11, 28, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(later, now=now.timestamp()) == pytest.approx(30.0)


_HAVE_ALL_PEERS = all(
    importlib.util.find_spec(f"pipelines.trading.peers.{name}") is not None for name in ("coach", "market")
)


@pytest.mark.skipif(not _HAVE_ALL_PEERS, reason="the coach and market peers are not written yet")
def test_serve_prints_the_urls_and_stops_on_sigterm() -> None:
    code = "from pipelines.trading.peers import serve; serve(0, 0, 0, 'kid', 'sec')"
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().strip() for _ in range(3)]
        assert [line.split("=", 1)[0] for line in lines] == ["broker", "market", "ai"]
        assert all(line.split("=", 1)[1].startswith("http://127.0.0.1:") for line in lines)
        broker_url = lines[0].split("=", 1)[1]
        assert httpx.get(f"{broker_url}/_peer/log").json() == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(not _HAVE_ALL_PEERS, reason="the coach and market peers are not written yet")
def test_trading_peers_start_and_stop_the_three() -> None:
    from pipelines.trading.peers import TradingPeers

    with TradingPeers(ai_key_id="kid", ai_secret="sec") as peers:
        urls = peers.urls()
        assert list(urls) == ["broker", "market", "ai"]
        assert urls["broker"] == peers.broker.url and urls["ai"] == peers.coach.url
        assert urls["market"] == peers.market.url and len(set(urls.values())) == 3
        assert httpx.get(f"{urls['broker']}/_peer/log").json() == []
    with pytest.raises(RuntimeError):
        peers.urls()
