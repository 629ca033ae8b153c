"""The v1 bias heuristics (every label at and just below its threshold, the confidence formula, the
ordering) and FIFO realized P/L."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.trading.heuristics import (
    BIAS_LABELS,
    LABELS,
    THRESHOLDS,
    BiasTag,
    TradeFacts,
    fifo_realized_pnl,
    tag,
)
from tasks.trading.series import Candle, local_indicators

TS = datetime(2024, 3, 1, 10, tzinfo=UTC)


def facts(**changes: Any) -> TradeFacts:
    base = TradeFacts(
        trade_id="t-1",
        symbol="BTC-USD",
        side="BUY",
        qty=0.5,
        price=43000.0,
        ts=TS,
        trades_prev_24h=0,
        minutes_since_prev=None,
        prev_realized_pnl=None,
    )
    return dataclasses.replace(base, **changes)


def indicators(**changes: float) -> dict[str, float]:
    values = {
        "rsi_14": 50.0,
        "return_24h": 0.0,
        "volatility_24h": 0.01,
        "volume_z": 0.0,
        "drawdown_24h": 0.0,
        "candles": 48.0,
    }
    values.update(changes)
    return values


def labels(tags: list[BiasTag]) -> list[str]:
    return [item.label for item in tags]


def by_label(tags: list[BiasTag], label: str) -> BiasTag:
    (found,) = [item for item in tags if item.label == label]
    return found


# --- each label: fires at its threshold, not just below ---------------------------------------


def test_nothing_fires_gives_neutral() -> None:
    tags = tag(facts(), indicators(), {})
    assert tags == [BiasTag("neutral", 1.0, {"trades_24h": 1, "return_24h": 0.0, "rsi_14": 50.0})]


@pytest.mark.parametrize(
    ("changes", "fires"),
    [
        ({"return_24h": 0.05}, True),
        ({"return_24h": 0.0499}, False),
        ({"rsi_14": 70.0}, True),
        ({"rsi_14": 69.99}, False),
        ({"return_24h": 0.2, "rsi_14": 85.0}, True),
    ],
)
def test_fomo(changes: dict[str, float], fires: bool) -> None:
    tags = tag(facts(side="BUY"), indicators(**changes), {})
    assert labels(tags) == (["fomo"] if fires else ["neutral"])
    if fires:
        features = tags[0].features
        assert features["side"] == "BUY"
        for key, value in changes.items():
            assert features[key] == value


def test_fomo_never_on_a_sell() -> None:
    assert labels(tag(facts(side="SELL"), indicators(return_24h=0.3, rsi_14=90.0), {})) == ["neutral"]


@pytest.mark.parametrize(
    ("changes", "fires"),
    [
        ({"return_24h": -0.05}, True),
        ({"return_24h": -0.0499}, False),
        ({"rsi_14": 30.0}, True),
        ({"rsi_14": 30.01}, False),
        ({"return_24h": -0.12, "rsi_14": 12.0}, True),
    ],
)
def test_panic_sell(changes: dict[str, float], fires: bool) -> None:
    tags = tag(facts(side="SELL"), indicators(**changes), {})
    assert labels(tags) == (["panic_sell"] if fires else ["neutral"])
    if fires:
        assert tags[0].features["side"] == "SELL"
        assert all(tags[0].features[key] == value for key, value in changes.items())


def test_panic_sell_never_on_a_buy() -> None:
    assert labels(tag(facts(side="BUY"), indicators(return_24h=-0.3, rsi_14=5.0), {})) == ["neutral"]


@pytest.mark.parametrize(
    ("minutes", "pnl", "fires"),
    [
        (30.0, -1.0, True),
        (0.0, -250.0, True),
        (30.01, -1.0, False),
        (5.0, 0.0, False),
        (5.0, 12.0, False),
        (5.0, None, False),
        (None, -10.0, False),
        (-3.0, -10.0, False),  # a clock glitch is not a revenge
    ],
)
def test_revenge_trading(minutes: float | None, pnl: float | None, fires: bool) -> None:
    tags = tag(facts(minutes_since_prev=minutes, prev_realized_pnl=pnl), indicators(), {})
    assert labels(tags) == (["revenge_trading"] if fires else ["neutral"])
    if fires:
        assert tags[0].features == {"minutes_since_loss": minutes, "prev_realized_pnl": pnl}


def test_revenge_prefers_the_minutes_since_the_losing_close() -> None:
    long_after_loss = facts(minutes_since_prev=2.0, minutes_since_prev_close=600.0, prev_realized_pnl=-5.0)
    right_after_loss = facts(minutes_since_prev=120.0, minutes_since_prev_close=10.0, prev_realized_pnl=-5.0)
    assert labels(tag(long_after_loss, indicators(), {})) == ["neutral"]
    assert labels(tag(right_after_loss, indicators(), {})) == ["revenge_trading"]


@pytest.mark.parametrize(("previous", "fires"), [(9, True), (8, False), (40, True), (0, False)])
def test_overtrading(previous: int, fires: bool) -> None:
    tags = tag(facts(trades_prev_24h=previous), indicators(), {})
    assert labels(tags) == (["overtrading"] if fires else ["neutral"])
    if fires:
        assert tags[0].features == {"trades_24h": previous + 1}


def test_every_label_fires_on_one_constructed_trade() -> None:
    buy = facts(side="BUY", trades_prev_24h=12, minutes_since_prev=3.0, prev_realized_pnl=-40.0)
    sell = dataclasses.replace(buy, side="SELL")
    assert set(labels(tag(buy, indicators(return_24h=0.08), {}))) == {
        "fomo",
        "overtrading",
        "revenge_trading",
    }
    assert set(labels(tag(sell, indicators(rsi_14=20.0), {}))) == {
        "panic_sell",
        "overtrading",
        "revenge_trading",
    }
    assert set(LABELS) == {*BIAS_LABELS, "neutral"}


# --- data sufficiency ------------------------------------------------------------------------


def test_indicators_from_too_short_a_window_do_not_count() -> None:
    assert labels(tag(facts(), indicators(rsi_14=80.0, candles=14.0), {})) == ["neutral"]
    assert labels(tag(facts(), indicators(rsi_14=80.0, candles=15.0), {})) == ["fomo"]
    assert labels(tag(facts(), indicators(return_24h=0.2, candles=24.0), {})) == ["neutral"]
    assert labels(tag(facts(), indicators(return_24h=0.2, candles=25.0), {})) == ["fomo"]


def test_zero_rsi_means_no_data_without_a_candle_count() -> None:
    no_count = {"rsi_14": 0.0, "return_24h": 0.0}
    assert labels(tag(facts(side="SELL"), no_count, {})) == ["neutral"]
    assert labels(tag(facts(side="SELL"), {"rsi_14": 12.0}, {})) == ["panic_sell"]
    assert labels(tag(facts(side="SELL"), indicators(rsi_14=0.0), {})) == ["panic_sell"]


def test_missing_or_garbage_indicators_are_ignored() -> None:
    garbage: dict[str, Any] = {"rsi_14": math.nan, "return_24h": "0.4", "candles": True, "symbol": "BTC-USD"}
    assert labels(tag(facts(), garbage, {})) == ["neutral"]
    assert labels(tag(facts(), {}, {})) == ["neutral"]


# --- confidence ------------------------------------------------------------------------------


def test_confidence_grows_past_the_threshold() -> None:
    def fomo(ret: float) -> float:
        return by_label(tag(facts(), indicators(return_24h=ret), {}), "fomo").confidence

    assert fomo(0.05) == 0.5
    assert fomo(0.075) == 0.75
    assert fomo(0.10) == 1.0
    assert fomo(0.5) == 1.0
    rsi = by_label(tag(facts(), indicators(rsi_14=80.0), {}), "fomo").confidence
    assert rsi == 0.75  # r = (80 - 50) / 20 = 1.5
    both = by_label(tag(facts(), indicators(return_24h=0.06, rsi_14=80.0), {}), "fomo").confidence
    assert both == 0.75  # the better of the two rules


def test_confidence_of_revenge_and_overtrading() -> None:
    revenge = tag(facts(minutes_since_prev=15.0, prev_realized_pnl=-1.0), indicators(), {})
    assert revenge[0].confidence == 0.75  # r = (60 - 15) / 30 = 1.5
    over = tag(facts(trades_prev_24h=13), indicators(), {})
    assert over[0].confidence == pytest.approx(0.5 + 0.5 * (13 / 9 - 1), abs=0.001)


def test_confidence_blends_the_ai_score() -> None:
    tags = tag(facts(), indicators(return_24h=0.075), {"fomo": 0.5, "panic_sell": 0.9})
    assert tags == [BiasTag("fomo", 0.675, {"return_24h": 0.075, "side": "BUY", "ai_score": 0.5})]
    low = tag(facts(), indicators(return_24h=0.05), {"fomo": 0.0})
    assert low[0].confidence == 0.35
    high = tag(facts(), indicators(return_24h=0.1), {"fomo": 1.0})
    assert high[0].confidence == 1.0


def test_ai_scores_are_clamped_and_foreign_ones_ignored() -> None:
    weird: dict[str, Any] = {"fomo": 7.0, "neutral": 1.0, "greed": 1.0, "overtrading": math.nan}
    tags = tag(facts(trades_prev_24h=9), indicators(return_24h=0.05), weird)
    assert by_label(tags, "fomo").confidence == 0.65  # 0.7 * 0.5 + 0.3 * 1.0
    assert by_label(tags, "overtrading").confidence == 0.5  # NaN score: no score
    assert "ai_score" not in by_label(tags, "overtrading").features


def test_neutral_confidence() -> None:
    # Halfway to fomo's return threshold: s = 1 - 0.5 * 0.5.
    assert tag(facts(), indicators(return_24h=0.025), {})[0].confidence == 0.75
    # The AI thinks it is probably panic: 0.7 * 1.0 + 0.3 * (1 - 0.8).
    tags = tag(facts(), indicators(), {"panic_sell": 0.8, "fomo": 0.1})
    assert tags == [
        BiasTag("neutral", 0.76, {"trades_24h": 1, "return_24h": 0.0, "rsi_14": 50.0, "ai_max_score": 0.8})
    ]
    # Just below a threshold is the least neutral it gets.
    assert tag(facts(trades_prev_24h=8), indicators(), {})[0].confidence == pytest.approx(
        1 - 0.5 * 8 / 9, abs=0.001
    )


def test_the_ai_alone_never_adds_a_label() -> None:
    assert labels(tag(facts(), indicators(), dict.fromkeys(BIAS_LABELS, 1.0))) == ["neutral"]


# --- shape -----------------------------------------------------------------------------------


def test_order_is_confidence_then_label() -> None:
    trade = facts(side="BUY", trades_prev_24h=9, minutes_since_prev=30.0, prev_realized_pnl=-1.0)
    tags = tag(trade, indicators(return_24h=0.1), {})
    assert [(item.label, item.confidence) for item in tags] == [
        ("fomo", 1.0),
        ("overtrading", 0.5),
        ("revenge_trading", 0.5),
    ]


def test_thresholds_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        THRESHOLDS.fomo_return_24h = 0.1  # type: ignore[misc]
    stricter = dataclasses.replace(THRESHOLDS, overtrading_trades_24h=3)
    assert labels(tag(facts(trades_prev_24h=2), indicators(), {}, thresholds=stricter)) == ["overtrading"]


def test_tags_from_real_candles() -> None:
    closes = [100.0] * 30 + [100.0 + i for i in range(1, 19)]  # +18 % over the last 18 hours
    candles = []
    for i, close in enumerate(closes):
        previous = closes[i - 1] if i else close
        candles.append(
            Candle(TS - timedelta(hours=len(closes) - 1 - i), previous, close, previous, close, 10.0)
        )
    values = local_indicators(candles, TS)
    assert values["return_24h"] == pytest.approx(0.18) and values["rsi_14"] == 100.0
    assert labels(tag(facts(side="BUY"), values, {})) == ["fomo"]
    assert labels(tag(facts(side="SELL"), values, {})) == ["neutral"]


FACTS = st.builds(
    TradeFacts,
    trade_id=st.text(min_size=1, max_size=8),
    symbol=st.sampled_from(["BTC-USD", "ETHUSDT"]),
    side=st.sampled_from(["BUY", "SELL"]),
    qty=st.floats(min_value=0.001, max_value=10),
    price=st.floats(min_value=0.01, max_value=1e5),
    ts=st.just(TS),
    trades_prev_24h=st.integers(min_value=0, max_value=100),
    minutes_since_prev=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    prev_realized_pnl=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    minutes_since_prev_close=st.none() | st.floats(min_value=0, max_value=1e4),
)
INDICATORS = st.fixed_dictionaries(
    {},
    optional={
        "rsi_14": st.floats(),
        "return_24h": st.floats(),
        "volatility_24h": st.floats(min_value=0, max_value=1),
        "volume_z": st.floats(min_value=-10, max_value=10),
        "drawdown_24h": st.floats(min_value=0, max_value=1),
        "candles": st.floats(min_value=0, max_value=48),
    },
)
SCORES = st.dictionaries(st.sampled_from([*LABELS, "other"]), st.floats(), max_size=6)


@settings(max_examples=500, deadline=None)
@given(trade=FACTS, values=INDICATORS, scores=SCORES)
def test_every_trade_gets_well_formed_tags(
    trade: TradeFacts, values: dict[str, float], scores: dict[str, float]
) -> None:
    tags = tag(trade, values, scores)
    assert tags
    names = labels(tags)
    assert len(set(names)) == len(names)
    assert set(names) <= set(LABELS)
    assert ("neutral" in names) == (names == ["neutral"])
    assert tags == sorted(tags, key=lambda item: (-item.confidence, item.label))
    for item in tags:
        assert 0.0 <= item.confidence <= 1.0 and round(item.confidence, 3) == item.confidence
        json.dumps(item.features, allow_nan=False)
    assert tag(trade, values, scores) == tags  # deterministic


# --- FIFO realized P/L -----------------------------------------------------------------------


def test_fifo_empty_and_buys_only() -> None:
    assert fifo_realized_pnl([]) == []
    assert fifo_realized_pnl([("BUY", 1, 100, 0), ("BUY", 2, 90, 1)]) == [None, None]


def test_fifo_full_close() -> None:
    assert fifo_realized_pnl([("BUY", 1, 100, 0), ("SELL", 1, 110, 0)]) == [None, 10.0]
    assert fifo_realized_pnl([("BUY", 1, 100, 0), ("SELL", 1, 90, 0)]) == [None, -10.0]


def test_fifo_fees_on_both_sides() -> None:
    # Lot cost 2 * 100 + 2 = 101 a unit; half of it sold at 110 with a 1 fee.
    assert fifo_realized_pnl([("BUY", 2, 100, 2), ("SELL", 1, 110, 1)]) == [None, 8.0]
    # The rest, a fee of 0.5: 110 - 101 - 0.5.
    trades = [("BUY", 2, 100, 2), ("SELL", 1, 110, 1), ("SELL", 1, 110, 0.5)]
    assert fifo_realized_pnl(trades) == [None, 8.0, 8.5]  # type: ignore[arg-type]


def test_fifo_partial_lots_in_order() -> None:
    trades = [
        ("BUY", 1, 100, 0),
        ("BUY", 1, 200, 0),
        ("SELL", 1.5, 300, 0),  # 1 @ 100 and 0.5 @ 200: 450 - 200
        ("SELL", 0.5, 100, 0),  # the last 0.5 @ 200
        ("BUY", 3, 10, 3),  # 11 a unit
        ("SELL", 1, 20, 0),
    ]
    assert fifo_realized_pnl(trades) == [None, None, 250.0, -50.0, None, 9.0]  # type: ignore[arg-type]


def test_fifo_one_sell_spanning_many_lots() -> None:
    trades: list[tuple[str, int, int, int]] = [("BUY", 1, 10 * (i + 1), 0) for i in range(5)]
    trades.append(("SELL", 5, 100, 5))
    assert fifo_realized_pnl(trades) == [None] * 5 + [500 - 150 - 5]  # type: ignore[arg-type]


def test_fifo_sell_beyond_holdings_ignores_the_unmatched_part() -> None:
    # Only 1 of 3 matched: 150 - 100, minus a third of the 3 fee.
    assert fifo_realized_pnl([("BUY", 1, 100, 0), ("SELL", 3, 150, 3)]) == [None, 49.0]


def test_fifo_sell_with_no_holdings_is_not_a_close() -> None:
    trades = [("SELL", 1, 100, 1), ("BUY", 1, 50, 0), ("SELL", 1, 60, 0), ("SELL", 1, 70, 0)]
    assert fifo_realized_pnl(trades) == [None, None, 10.0, None]  # type: ignore[arg-type]


def test_fifo_is_exact_with_decimal_fractions() -> None:
    trades = [("BUY", 0.1, 0.3, 0)] * 3 + [("SELL", 0.3, 0.4, 0)]
    assert fifo_realized_pnl(trades) == [None, None, None, 0.03]  # type: ignore[arg-type]
    decimals = [
        ("BUY", Decimal("0.5"), Decimal("43000.1"), Decimal("0.2")),
        ("SELL", Decimal("0.5"), 43100, 0),
    ]
    # 0.5 * 43100 - (0.5 * 43000.1 + 0.2)
    assert fifo_realized_pnl(decimals) == [None, 49.75]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        ("HOLD", 1, 1, 0),
        ("BUY", 0, 1, 0),
        ("SELL", -1, 1, 0),
        ("BUY", 1, -1, 0),
        ("BUY", 1, 1, -0.1),
        ("BUY", math.nan, 1, 0),
        ("BUY", 1, math.inf, 0),
        ("BUY", True, 1, 0),
        ("BUY", "1", 1, 0),
    ],
)
def test_fifo_refuses_malformed_trades(bad: tuple[Any, Any, Any, Any]) -> None:
    with pytest.raises(ValueError):
        fifo_realized_pnl([bad])


@st.composite
def long_only_trades(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    """BUYs and SELLs never selling more than held, closed flat at the end."""
    trades: list[tuple[str, int, int, int]] = []
    held = 0
    for _ in range(draw(st.integers(min_value=1, max_value=25))):
        price = draw(st.integers(min_value=1, max_value=1000))
        fee = draw(st.integers(min_value=0, max_value=5))
        if held and draw(st.booleans()):
            qty = draw(st.integers(min_value=1, max_value=held))
            trades.append(("SELL", qty, price, fee))
            held -= qty
        else:
            qty = draw(st.integers(min_value=1, max_value=20))
            trades.append(("BUY", qty, price, fee))
            held += qty
    if held:
        trades.append(("SELL", held, draw(st.integers(min_value=1, max_value=1000)), 0))
    return trades


@settings(max_examples=300, deadline=None)
@given(trades=long_only_trades())
def test_fifo_realized_total_is_cash_flow_when_flat(trades: list[tuple[str, int, int, int]]) -> None:
    pnl = fifo_realized_pnl(trades)  # type: ignore[arg-type]
    assert [value is None for value in pnl] == [side == "BUY" for side, *_ in trades]
    cash = sum((q * p if side == "SELL" else -q * p) - fee for side, q, p, fee in trades)
    assert sum(value for value in pnl if value is not None) == pytest.approx(cash)
