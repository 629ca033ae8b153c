"""The simple model of ``simulate.simple`` (tasks.trading.simulation), by hand-computed
cases: a SELL's hold is the qty kept, a BUY's hold is staying in cash; the trade's own
candle, the window's bounds, empty and partial windows, fees, rounding and bad input."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from tasks.trading.series import Candle
from tasks.trading.simulation import simulate

TS = datetime(2025, 3, 3, 10, 30, tzinfo=UTC)
HOUR = timedelta(hours=1)


def candle(t: datetime, close: float) -> Candle:
    return Candle(t, close, close, close, close, 1.0)


def hourly(first: datetime, closes: list[float]) -> list[Candle]:
    return [candle(first + k * HOUR, c) for k, c in enumerate(closes)]


# The trade's candle starts at 10:00 and closes at 11:00, then 12:00, 13:00.
CANDLES = hourly(datetime(2025, 3, 3, 10, tzinfo=UTC), [101.0, 104.0, 98.0])
END = TS + 3 * HOUR  # 13:30


def test_a_sell_holds_the_qty_it_sold() -> None:
    result = simulate("SELL", 2, 100.0, 0.5, TS, CANDLES, end=END)
    assert result["t"] == [
        "2025-03-03T10:30:00Z",
        "2025-03-03T11:00:00Z",
        "2025-03-03T12:00:00Z",
        "2025-03-03T13:00:00Z",
    ]
    assert result["hold"] == [0.0, 2.0, 8.0, -4.0]  # 2 * (close - 100)
    assert result["actual"] == [-0.5, -0.5, -0.5, -0.5]  # sold: the fee, then cash
    assert result["delta"] == -3.5  # -4 - (-0.5): selling escaped a fall, net of the fee
    assert result["end"] == "2025-03-03T13:30:00Z"
    assert result["partial"] is False


def test_a_buy_holds_cash() -> None:
    result = simulate("BUY", 2, 100.0, 0.5, TS, CANDLES, end=END)
    assert result["hold"] == [0.0, 0.0, 0.0, 0.0]
    assert result["actual"] == [-0.5, 1.5, 7.5, -4.5]  # 2 * (close - 100) - 0.5
    assert result["delta"] == 4.5  # not buying would have been 4.5 better
    assert result["partial"] is False


def test_delta_is_the_one_formula() -> None:
    for side, sign in (("SELL", 1), ("BUY", -1)):
        for qty, price, fee, last in ((0.25, 40_000.0, 3.0, 41_234.5), (10, 7.5, 0.0, 6.0)):
            candles = [candle(datetime(2025, 3, 3, 11, tzinfo=UTC), last)]
            result = simulate(side, qty, price, fee, TS, candles, end=END)
            assert result["delta"] == pytest.approx(sign * qty * (last - price) + fee)
            assert result["hold"][-1] - result["actual"][-1] == pytest.approx(result["delta"])


def test_a_rise_after_a_sell_is_what_the_seller_gave_up() -> None:
    rise = hourly(datetime(2025, 3, 3, 10, tzinfo=UTC), [110.0, 120.0])
    sell = simulate("sell", 1.5, 100.0, 0.0, TS, rise, end=TS + 2 * HOUR)
    assert sell["hold"] == [0.0, 15.0, 30.0]
    assert sell["delta"] == 30.0  # positive: selling cost 30
    buy = simulate("buy", 1.5, 100.0, 0.0, TS, rise, end=TS + 2 * HOUR)
    assert buy["actual"] == [0.0, 15.0, 30.0]
    assert buy["delta"] == -30.0  # negative: the buy paid off


def test_candles_outside_the_window_are_ignored_in_any_order() -> None:
    before = candle(datetime(2025, 3, 3, 9, tzinfo=UTC), 1.0)  # closes at 10:00, before the trade
    after = candle(datetime(2025, 3, 3, 13, tzinfo=UTC), 1_000.0)  # closes at 14:00, after the end
    mixed = [after, CANDLES[2], before, CANDLES[0], CANDLES[1]]
    assert simulate("SELL", 2, 100.0, 0.5, TS, mixed, end=END) == simulate(
        "SELL", 2, 100.0, 0.5, TS, CANDLES, end=END
    )
    # A candle closing exactly at the end counts; one closing exactly at ts does not.
    on_the_hour = datetime(2025, 3, 3, 10, tzinfo=UTC)
    exact = simulate(
        "SELL", 1, 100.0, 0.0, on_the_hour, hourly(on_the_hour - HOUR, [50.0, 90.0]), end=on_the_hour + HOUR
    )
    assert exact["t"] == ["2025-03-03T10:00:00Z", "2025-03-03T11:00:00Z"]
    assert exact["hold"] == [0.0, -10.0]


def test_no_candles_is_the_trade_alone_and_partial() -> None:
    for side, delta in (("SELL", 0.5), ("BUY", 0.5)):
        result = simulate(side, 2, 100.0, 0.5, TS, [], end=END)
        assert result["t"] == ["2025-03-03T10:30:00Z"]
        assert (result["hold"], result["actual"]) == ([0.0], [-0.5])
        assert result["delta"] == delta  # the fee not paid
        assert result["partial"] is True
    # A horizon of nothing is complete with the trade alone.
    assert simulate("BUY", 1, 100.0, 0.0, TS, [], end=TS)["partial"] is False


def test_candles_that_stop_early_are_partial() -> None:
    end = TS + 5 * HOUR  # 15:30; the candles stop at 13:00
    result = simulate("SELL", 2, 100.0, 0.5, TS, CANDLES, end=end)
    assert result["partial"] is True
    assert result["t"][-1] == "2025-03-03T13:00:00Z" and result["end"] == "2025-03-03T15:30:00Z"
    assert result["delta"] == -3.5  # the last point the candles give
    # Less than a step short of the end is complete: the next candle would close after it.
    almost = datetime(2025, 3, 3, 13, 59, tzinfo=UTC)
    assert simulate("SELL", 2, 100.0, 0.5, TS, CANDLES, end=almost)["partial"] is False
    # The candle closing exactly at the end is missing: partial.
    on_the_hour = datetime(2025, 3, 3, 14, tzinfo=UTC)
    assert simulate("SELL", 2, 100.0, 0.5, TS, CANDLES, end=on_the_hour)["partial"] is True


def test_a_daily_step_closes_a_day_later() -> None:
    day = timedelta(days=1)
    days = [candle(datetime(2025, 3, 3, tzinfo=UTC) + k * day, c) for k, c in enumerate([100.0, 90.0])]
    result = simulate("SELL", 1, 95.0, 0.0, TS, days, end=TS + 2 * day, step=day)
    assert result["t"] == ["2025-03-03T10:30:00Z", "2025-03-04T00:00:00Z", "2025-03-05T00:00:00Z"]
    assert result["hold"] == [0.0, 5.0, -5.0]
    assert result["partial"] is False


def test_values_are_rounded_to_six_decimals_without_minus_zero() -> None:
    candles = [candle(datetime(2025, 3, 3, 11, tzinfo=UTC), 0.3)]
    result = simulate("SELL", 3, 0.1, 0.0, TS, candles, end=END)
    assert result["hold"] == [0.0, 0.6]  # 3 * (0.3 - 0.1) is 0.6000000000000001 unrounded
    tiny = simulate(
        "BUY", 1e-9, 100.0, 0.0, TS, [candle(datetime(2025, 3, 3, 11, tzinfo=UTC), 99.0)], end=END
    )
    assert tiny["actual"] == [0.0, 0.0] and math.copysign(1, tiny["actual"][1]) == 1
    assert math.copysign(1, tiny["delta"]) == 1


def test_naive_times_are_utc() -> None:
    naive = simulate("SELL", 2, 100.0, 0.5, TS.replace(tzinfo=None), CANDLES, end=END.replace(tzinfo=None))
    assert naive == simulate("SELL", 2, 100.0, 0.5, TS, CANDLES, end=END)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("HOLD", 1, 100.0, 0.0), "side"),
        (("BUY", 0, 100.0, 0.0), "qty"),
        (("BUY", -1, 100.0, 0.0), "qty"),
        (("BUY", 1, float("nan"), 0.0), "price"),
        (("BUY", 1, 0.0, 0.0), "price"),
        (("BUY", 1, 100.0, -0.1), "fee"),
        (("BUY", True, 100.0, 0.0), "qty"),
    ],
)
def test_bad_input_is_refused(args: tuple[str, float, float, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(*args, TS, CANDLES, end=END)


def test_an_end_before_the_trade_or_a_bad_step_is_refused() -> None:
    with pytest.raises(ValueError, match="end"):
        simulate("BUY", 1, 100.0, 0.0, TS, CANDLES, end=TS - HOUR)
    with pytest.raises(ValueError, match="step"):
        simulate("BUY", 1, 100.0, 0.0, TS, CANDLES, end=END, step=timedelta(0))
