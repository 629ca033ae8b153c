"""Candles, the window before a trade, sparklines and the local indicators, against hand-computed
numbers."""

from __future__ import annotations

import itertools
import json
import math
import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.trading.series import INDICATOR_KEYS, Candle, local_indicators, spark, window_before

START = datetime(2024, 3, 1, tzinfo=UTC)


def hourly(
    closes: list[float], *, volumes: list[float] | None = None, start: datetime = START
) -> list[Candle]:
    """Consistent hourly candles whose opens are the previous closes."""
    candles = []
    previous = closes[0]
    for i, close in enumerate(closes):
        volume = volumes[i] if volumes is not None else 100.0
        high, low = max(previous, close), min(previous, close)
        candles.append(Candle(start + timedelta(hours=i), previous, high, low, close, volume))
        previous = close
    return candles


def test_candle_json_round_trip() -> None:
    candle = Candle(datetime(2024, 3, 1, 10, tzinfo=UTC), 1.0, 2.5, 0.5, 2.0, 123.25)
    data = candle.to_json()
    assert data == {"t": "2024-03-01T10:00:00Z", "o": 1.0, "h": 2.5, "l": 0.5, "c": 2.0, "v": 123.25}
    assert Candle.from_json(json.loads(json.dumps(data))) == candle


def test_candle_from_json_offsets_naive_and_strings() -> None:
    offset = Candle.from_json(
        {"t": "2024-03-01T12:00:00+02:00", "o": "1", "h": 2, "l": 0.5, "c": 1.5, "v": 0}
    )
    naive = Candle.from_json({"t": "2024-03-01T10:00:00", "o": 1, "h": 2, "l": 0.5, "c": 1.5, "v": 0})
    assert offset.t == naive.t == datetime(2024, 3, 1, 10, tzinfo=UTC)
    assert offset.o == 1.0 and isinstance(offset.h, float)


@pytest.mark.parametrize(
    "data",
    [
        {"t": "never", "o": 1, "h": 1, "l": 1, "c": 1, "v": 1},
        {"t": 5, "o": 1, "h": 1, "l": 1, "c": 1, "v": 1},
        {"t": "2024-03-01T10:00:00Z", "o": "x", "h": 1, "l": 1, "c": 1, "v": 1},
        {"t": "2024-03-01T10:00:00Z", "o": True, "h": 1, "l": 1, "c": 1, "v": 1},
        {"t": "2024-03-01T10:00:00Z", "o": 1, "h": 1, "l": 1, "c": 1},
    ],
)
def test_candle_from_json_refuses_malformed(data: dict[str, object]) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        Candle.from_json(data)


def test_window_before_counts_candles_at_or_before_ts() -> None:
    candles = hourly([float(i + 1) for i in range(100)])
    ts = START + timedelta(hours=60, minutes=30)
    window = window_before(candles, ts)
    assert len(window) == 48
    assert window[-1].t == START + timedelta(hours=60)
    assert window[0].t == START + timedelta(hours=13)
    assert window_before(candles, START + timedelta(hours=60)) == window  # t == ts is in
    assert window_before(candles, ts, hours=5) == candles[56:61]
    assert window_before(candles, START - timedelta(seconds=1)) == []
    assert window_before(candles, ts, hours=0) == []
    assert window_before(candles, START + timedelta(hours=2), hours=48) == candles[:3]


def test_window_before_sorts_and_takes_naive_ts_as_utc() -> None:
    candles = hourly([1.0, 2.0, 3.0, 4.0])
    shuffled = [candles[2], candles[0], candles[3], candles[1]]
    naive = datetime(2024, 3, 1, 2, 15)
    assert window_before(shuffled, naive) == candles[:3]


def test_window_before_counts_candles_over_a_weekend_gap() -> None:
    friday = hourly([10.0] * 8, start=datetime(2024, 3, 1, 9, tzinfo=UTC))
    monday = hourly([11.0] * 2, start=datetime(2024, 3, 4, 9, tzinfo=UTC))
    window = window_before(friday + monday, datetime(2024, 3, 4, 10, 30, tzinfo=UTC), hours=5)
    assert [candle.t.day for candle in window] == [1, 1, 1, 4, 4]


def test_spark_scales_the_last_closes() -> None:
    candles = hourly([5.0, 10.0, 20.0, 15.0, 30.0])
    assert spark(candles, START + timedelta(hours=4), points=4) == [0.0, 0.5, 0.25, 1.0]
    assert spark(candles, START + timedelta(hours=1, minutes=59)) == [0.0, 1.0]
    assert spark(candles, START + timedelta(hours=2), points=3) == [0.0, 0.333, 1.0]


def test_spark_flat_empty_and_length() -> None:
    assert spark(hourly([7.0] * 30), START + timedelta(hours=40)) == [0.5] * 24
    assert spark(hourly([7.0]), START) == [0.5]
    assert spark([], START) == []
    assert spark(hourly([1.0, 2.0]), START - timedelta(hours=1)) == []
    values = spark(hourly([float(i % 7) + 1 for i in range(100)]), START + timedelta(hours=99))
    assert len(values) == 24 and min(values) == 0.0 and max(values) == 1.0


def test_indicators_keys_and_no_data() -> None:
    empty = local_indicators([], START)
    assert set(empty) == set(INDICATOR_KEYS)
    assert all(value == 0.0 for value in empty.values())
    one = local_indicators(hourly([100.0]), START)
    assert one == {key: 0.0 for key in INDICATOR_KEYS} | {"candles": 1.0}


def test_return_24h_uses_the_close_24_candles_back() -> None:
    closes = [100.0] * 30 + [110.0] * 20  # the last 24 closes are from index 26 on
    candles = hourly(closes)
    ts = candles[-1].t
    closes_window = closes[-48:]
    expected = closes_window[-1] / closes_window[-25] - 1
    assert local_indicators(candles, ts)["return_24h"] == pytest.approx(expected)
    assert local_indicators(candles, ts)["return_24h"] == pytest.approx(0.1)
    # 24 candles are not enough for a 24 h return.
    assert local_indicators(hourly([100.0] * 23 + [200.0]), START + timedelta(hours=23))["return_24h"] == 0.0
    assert local_indicators(hourly([100.0] * 24 + [200.0]), START + timedelta(hours=24))["return_24h"] == 1.0


def wilder_rsi(closes: list[float]) -> float:
    """An independent RSI(14): the classic spreadsheet recurrence."""
    ups = [max(b - a, 0) for a, b in itertools.pairwise(closes)]
    downs = [max(a - b, 0) for a, b in itertools.pairwise(closes)]
    avg_up, avg_down = sum(ups[:14]) / 14, sum(downs[:14]) / 14
    for up, down in zip(ups[14:], downs[14:], strict=True):
        avg_up = (13 * avg_up + up) / 14
        avg_down = (13 * avg_down + down) / 14
    return 100 - 100 / (1 + avg_up / avg_down)


def test_rsi_matches_wilder() -> None:
    rng = random.Random(3)
    closes = [100.0]
    for _ in range(79):
        closes.append(closes[-1] * math.exp(rng.gauss(0, 0.01)))
    candles = hourly(closes)
    assert local_indicators(candles, candles[-1].t)["rsi_14"] == pytest.approx(
        wilder_rsi(closes[-48:]), abs=1e-6
    )


def test_rsi_extremes_and_too_short() -> None:
    rising = hourly([100.0 + i for i in range(20)])
    falling = hourly([100.0 - i for i in range(20)])
    flat = hourly([100.0] * 20)
    assert local_indicators(rising, rising[-1].t)["rsi_14"] == 100.0
    assert local_indicators(falling, falling[-1].t)["rsi_14"] == 0.0
    assert local_indicators(flat, flat[-1].t)["rsi_14"] == 50.0
    short = hourly([100.0 + i for i in range(14)])
    assert local_indicators(short, short[-1].t)["rsi_14"] == 0.0
    assert local_indicators(short, short[-1].t)["candles"] == 14.0


def test_volatility_is_the_sample_std_of_the_last_24_log_returns() -> None:
    rng = random.Random(5)
    closes = [50.0]
    for _ in range(59):
        closes.append(closes[-1] * math.exp(rng.gauss(0, 0.02)))
    candles = hourly(closes)
    returns = [math.log(b / a) for a, b in zip(closes[-25:-1], closes[-24:], strict=True)]
    mean = sum(returns) / 24
    expected = math.sqrt(sum((r - mean) ** 2 for r in returns) / 23)
    assert local_indicators(candles, candles[-1].t)["volatility_24h"] == pytest.approx(expected, abs=1e-6)
    flat = hourly([10.0] * 30)
    assert local_indicators(flat, flat[-1].t)["volatility_24h"] == 0.0
    assert local_indicators(hourly([1.0, 2.0]), START + timedelta(hours=1))["volatility_24h"] == 0.0
    three = local_indicators(hourly([1.0, 2.0, 1.0]), START + timedelta(hours=2))["volatility_24h"]
    assert three == pytest.approx(round(math.sqrt(2) * math.log(2), 6))


def test_volume_z_of_the_last_volume() -> None:
    volumes = [100.0] * 47 + [500.0]
    candles = hourly([10.0] * 48, volumes=volumes)
    mean = sum(volumes) / 48
    std = math.sqrt(sum((v - mean) ** 2 for v in volumes) / 48)
    z = local_indicators(candles, candles[-1].t)["volume_z"]
    assert z == pytest.approx((500 - mean) / std, abs=1e-6)
    assert z > 6
    quiet = hourly([10.0] * 48, volumes=[100.0] * 47 + [0.0])
    assert local_indicators(quiet, quiet[-1].t)["volume_z"] < -6
    same = hourly([10.0] * 48, volumes=[0.1] * 48)
    assert local_indicators(same, same[-1].t)["volume_z"] == 0.0


def test_drawdown_from_the_24h_high() -> None:
    closes = [100.0] * 30 + [120.0] + [90.0] * 10
    candles = hourly(closes)
    assert local_indicators(candles, candles[-1].t)["drawdown_24h"] == pytest.approx(0.25)
    rising = hourly([float(i + 1) for i in range(30)])
    assert local_indicators(rising, rising[-1].t)["drawdown_24h"] == 0.0
    # A peak older than 24 candles no longer counts.
    old_peak = hourly([200.0] + [100.0] * 30)
    assert local_indicators(old_peak, old_peak[-1].t)["drawdown_24h"] == 0.0


def test_drawdown_uses_intrabar_highs() -> None:
    candles = hourly([100.0] * 30)
    spiked = [*candles[:-2], Candle(candles[-2].t, 100.0, 125.0, 99.0, 100.0, 1.0), candles[-1]]
    assert local_indicators(spiked, spiked[-1].t)["drawdown_24h"] == pytest.approx(0.2)


def test_bad_prices_give_zeros_not_errors() -> None:
    candles = hourly([100.0] * 30 + [0.0] + [100.0] * 20)
    values = local_indicators(candles, candles[-1].t)
    assert values["rsi_14"] == 0.0 and values["volatility_24h"] == 0.0
    nan = hourly([100.0] * 49 + [math.nan])
    values = local_indicators(nan, nan[-1].t)
    assert all(math.isfinite(value) for value in values.values())
    json.dumps(values, allow_nan=False)


def test_indicators_ignore_candles_after_ts_and_are_deterministic() -> None:
    rng = random.Random(11)
    closes = [100.0]
    for _ in range(199):
        closes.append(closes[-1] * math.exp(rng.gauss(0, 0.01)))
    candles = hourly(closes, volumes=[rng.uniform(50, 150) for _ in closes])
    ts = candles[120].t + timedelta(minutes=10)
    assert local_indicators(candles, ts) == local_indicators(candles[:121], ts)
    assert local_indicators(list(reversed(candles)), ts) == local_indicators(candles, ts)
    values = local_indicators(candles, ts)
    assert values["candles"] == 48.0
    assert all(round(value, 6) == value for value in values.values())


EXTREME = st.floats() | st.sampled_from([1e-308, 1e308, 5e-324, 0.0, -1.0])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 100), EXTREME, EXTREME, EXTREME), max_size=60),
    at=st.integers(0, 120),
)
def test_never_raises_and_stays_finite(rows: list[tuple[int, float, float, float]], at: int) -> None:
    candles = [Candle(START + timedelta(hours=h), c, high, c, c, v) for h, c, high, v in rows]
    ts = START + timedelta(hours=at)
    values = local_indicators(candles, ts)
    assert set(values) == set(INDICATOR_KEYS)
    assert all(math.isfinite(value) for value in values.values())
    assert all(0.0 <= value <= 1.0 for value in spark(candles, ts))
