"""The AI coach peer through the real client over loopback HTTP: each endpoint, signatures
refused and accepted, tries after a failure signed afresh, the faults, and the stats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from conveyor.errors import PermanentError, TransientError
from pipelines.trading.peers.coach import BIAS_LABELS, CoachPeer
from tasks.trading.coach import CoachClient
from tasks.trading.errors import CoachUnauthorized, PeerUnavailable
from tasks.trading.series import Candle, local_indicators
from tasks.trading.signing import sign

KEY_ID = "k1"
SECRET = "peer-secret-4f1c"
T0 = datetime(2024, 3, 1, tzinfo=UTC)


@pytest.fixture
def peer() -> Iterator[CoachPeer]:
    with CoachPeer("127.0.0.1", 0, KEY_ID, SECRET) as running:
        yield running


@pytest.fixture
def client(peer: CoachPeer) -> Iterator[CoachClient]:
    with CoachClient(peer.url, key_id=KEY_ID, secret=SECRET) as coach:
        yield coach


def _series(n: int = 48) -> list[Candle]:
    closes = [100.0 * (1.0 + 0.004 * ((i * 7) % 5 - 2) + 0.002 * i) for i in range(n)]
    return [
        Candle(T0 + timedelta(hours=i), closes[i - 1] if i else 100.0, c * 1.01, c * 0.98, c, 10.0 + i % 4)
        for i, c in enumerate(closes)
    ]


def _trades() -> list[dict[str, object]]:
    return [
        {"tradeId": f"t{i}", "symbol": "BTC-USD", "side": "BUY", "qty": 0.1, "price": 40_000, "ts": T0}
        for i in range(5)
    ]


def test_indicators_are_local_indicators_of_the_series(client: CoachClient) -> None:
    series = _series()
    ts = series[-1].t + timedelta(minutes=20)
    answer = client.indicators("BTC-USD", ts, series)
    assert answer == local_indicators(series, ts)
    assert set(answer) >= {"rsi_14", "return_24h", "volatility_24h", "volume_z", "drawdown_24h"}


def test_indicators_of_an_empty_series_are_zeros(client: CoachClient) -> None:
    answer = client.indicators("AAPL", T0, [])
    assert all(value == 0.0 for value in answer.values())


def test_bias_scores_every_trade_and_label_reproducibly(client: CoachClient, peer: CoachPeer) -> None:
    first = client.bias("u1", _trades())
    assert set(first) == {f"t{i}" for i in range(5)}
    for scores in first.values():
        assert set(scores) == set(BIAS_LABELS)
        assert all(0.0 <= score <= 1.0 for score in scores.values())
    assert client.bias("u1", _trades()) == first
    # Another peer, another process's worth of state: the same scores.
    with (
        CoachPeer("127.0.0.1", 0, KEY_ID, SECRET) as other,
        CoachClient(other.url, key_id=KEY_ID, secret=SECRET) as again,
    ):
        assert again.bias("someone-else", _trades()[:2]) == {k: first[k] for k in ("t0", "t1")}
    assert len({tuple(s.values()) for s in first.values()}) == 5  # trades differ


def test_bias_accepts_decimals_and_integer_ids(client: CoachClient) -> None:
    from decimal import Decimal

    answer = client.bias("u1", [{"tradeId": 42, "qty": Decimal("0.5"), "price": Decimal("1.25"), "ts": T0}])
    assert set(answer) == {"42"}


@pytest.mark.parametrize("label", [*BIAS_LABELS, "neutral", "something_new"])
@pytest.mark.parametrize("tone", ["supportive", "strict"])
def test_reflect_answers_a_sentence_per_label_and_tone(client: CoachClient, label: str, tone: str) -> None:
    features = {"return_24h": 0.071, "rsi_14": 74.2, "minutes_since_loss": 12.0, "trades_24h": 14}
    text = client.reflect(features, label, tone)
    assert text and text.endswith(".") and len(text) < 200
    assert client.reflect(features, label, tone) == text


def test_reflect_fills_the_features_and_tones_differ(client: CoachClient) -> None:
    assert "7.1% rise" in client.reflect({"return_24h": 0.071}, "fomo")
    assert "12 minutes" in client.reflect({"minutes_since_loss": 12.0}, "revenge_trading", "strict")
    assert "14 trades" in client.reflect({"trades_24h": 14}, "overtrading")
    assert client.reflect({}, "panic_sell", "strict") != client.reflect({}, "panic_sell", "supportive")


def test_an_unknown_tone_is_a_permanent_refusal(client: CoachClient) -> None:
    with pytest.raises(PermanentError, match=r"/v1/nlg/reflect .*HTTP 400.*tone"):
        client.reflect({}, "fomo", "sarcastic")


def test_a_wrong_secret_is_refused_with_the_peers_reason_and_never_shows_the_secret(peer: CoachPeer) -> None:
    wrong = "wrong-secret-9b2e"
    with (
        CoachClient(peer.url, key_id=KEY_ID, secret=wrong) as bad,
        pytest.raises(CoachUnauthorized) as caught,
    ):
        bad.bias("u1", _trades())
    message = str(caught.value)
    assert "/v1/bias" in message and "bad signature" in message
    assert wrong not in message and SECRET not in message and wrong not in repr(bad)
    assert not isinstance(caught.value, TransientError)
    assert peer.stats()["rejected"] == {"bad signature": 1}


def test_an_unknown_key_id_is_refused(peer: CoachPeer) -> None:
    with (
        CoachClient(peer.url, key_id="nobody", secret=SECRET) as bad,
        pytest.raises(CoachUnauthorized, match="unknown key id"),
    ):
        bad.indicators("BTC-USD", T0, [])


def test_an_unsigned_request_is_refused_naming_the_header(peer: CoachPeer) -> None:
    response = httpx.post(f"{peer.url}/v1/bias", json={"userId": "u1", "trades": []})
    assert response.status_code == 401
    assert response.json() == {"error": "missing header X-KeyId"}


def test_a_request_sent_twice_with_one_signature_is_a_replay(peer: CoachPeer) -> None:
    body = json.dumps({"userId": "u1", "trades": []}).encode()
    headers = sign(KEY_ID, SECRET, "POST", "/v1/bias", body)
    first = httpx.post(f"{peer.url}/v1/bias", content=body, headers=headers)
    second = httpx.post(f"{peer.url}/v1/bias", content=body, headers=headers)
    assert first.status_code == 200
    assert (second.status_code, second.json()) == (401, {"error": "replayed nonce"})


def test_a_timestamp_six_minutes_old_is_clock_skew(peer: CoachPeer) -> None:
    body = b'{"userId":"u1","trades":[]}'
    headers = sign(KEY_ID, SECRET, "POST", "/v1/bias", body, now=datetime.now(UTC).timestamp() - 360)
    response = httpx.post(f"{peer.url}/v1/bias", content=body, headers=headers)
    assert (response.status_code, response.json()) == (401, {"error": "clock skew"})


def test_a_retry_after_a_failure_is_signed_afresh_and_never_401s(
    peer: CoachPeer, client: CoachClient
) -> None:
    peer.faults(fail_5xx=1)
    with pytest.raises(PeerUnavailable):
        client.bias("u1", _trades())
    assert len(client.bias("u1", _trades())) == 5  # the same logical call, tried again
    peer.faults(down=True)
    with pytest.raises(PeerUnavailable):
        client.bias("u1", _trades())
    peer.faults(clear=True)
    assert len(client.bias("u1", _trades())) == 5
    stats = peer.stats()
    assert stats["rejected"] == {}
    assert stats["requests"]["/v1/bias"] == 4 and stats["accepted"] == 2


def test_down_closes_the_connection_and_the_client_sees_peer_unavailable(
    peer: CoachPeer, client: CoachClient
) -> None:
    assert client.reflect({}, "fomo")  # a kept-alive connection exists before the peer goes down
    peer.faults(down=True)
    for call in (lambda: client.reflect({}, "fomo"), lambda: client.indicators("X", T0, [])):
        with pytest.raises(PeerUnavailable, match="could not be reached") as caught:
            call()
        assert isinstance(caught.value, TransientError)
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{peer.url}/v1/bias", content=b"{}")
    peer.faults(down=False)
    assert client.reflect({}, "fomo")


def test_fail_5xx_answers_503_for_the_next_n_then_recovers(peer: CoachPeer, client: CoachClient) -> None:
    peer.faults(fail_5xx=2)
    for endpoint, call in (
        ("/v1/indicators", lambda: client.indicators("X", T0, [])),
        ("/v1/nlg/reflect", lambda: client.reflect({}, "fomo")),
    ):
        with pytest.raises(PeerUnavailable, match=f"AI coach {endpoint} answered HTTP 503"):
            call()
    assert client.reflect({}, "fomo")
    assert peer.faults()["fail_5xx"] == 0


def test_a_slow_peer_is_a_timeout(peer: CoachPeer) -> None:
    peer.faults(latency_ms=1500)
    with (
        CoachClient(peer.url, key_id=KEY_ID, secret=SECRET, timeout=0.2) as hasty,
        pytest.raises(PeerUnavailable, match="/v1/bias timed out"),
    ):
        hasty.bias("u1", [])


def test_on_request_reports_every_try_with_its_endpoint(peer: CoachPeer) -> None:
    seen: list[tuple[str, float]] = []
    with CoachClient(
        peer.url, key_id=KEY_ID, secret=SECRET, on_request=lambda e, s: seen.append((e, s))
    ) as coach:
        coach.bias("u1", [])
        peer.faults(fail_5xx=1)
        with pytest.raises(PeerUnavailable):
            coach.reflect({}, "fomo")
    assert [endpoint for endpoint, _ in seen] == ["/v1/bias", "/v1/nlg/reflect"]
    assert all(0 <= seconds < 2 for _, seconds in seen)


def test_stats_and_faults_over_http_without_auth(peer: CoachPeer, client: CoachClient) -> None:
    client.bias("u1", [])
    client.reflect({}, "fomo")
    with CoachClient(peer.url, key_id=KEY_ID, secret="nope") as bad, pytest.raises(CoachUnauthorized):
        bad.reflect({}, "fomo")
    stats = httpx.get(f"{peer.url}/_peer/stats").json()
    assert stats == peer.stats()
    assert stats == {
        "requests": {"/v1/bias": 1, "/v1/nlg/reflect": 2},
        "rejected": {"bad signature": 1},
        "accepted": 2,
    }
    set_faults = httpx.post(f"{peer.url}/_peer/faults", json={"latency_ms": 5, "fail_5xx": 1})
    assert set_faults.json() == {"latency_ms": 5.0, "down": False, "fail_5xx": 1}
    assert httpx.post(f"{peer.url}/_peer/faults", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{peer.url}/_peer/faults", json={"down": "yes"}).status_code == 400
    cleared = httpx.post(f"{peer.url}/_peer/faults", json={"clear": True}).json()
    assert cleared == {"latency_ms": 0.0, "down": False, "fail_5xx": 0}


def test_no_error_message_carries_the_secret(peer: CoachPeer) -> None:
    messages: list[str] = []
    with CoachClient(peer.url, key_id=KEY_ID, secret=SECRET, timeout=0.2) as coach:
        for faults in ({"fail_5xx": 1}, {"down": True}, {"clear": True, "latency_ms": 500}):
            peer.faults(**faults)
            with pytest.raises(PeerUnavailable) as caught:
                coach.bias("u1", [])
            messages.append(str(caught.value))
        peer.faults(clear=True)
        with pytest.raises(PermanentError) as refused:
            coach.reflect({}, "fomo", "rude")
        messages.append(str(refused.value))
        assert SECRET not in repr(coach)
    assert all(SECRET not in message for message in messages)
