"""The digest's pure aggregation: hand-computed windows, empty and buy-only periods, lots opened
before the window, streak edges, attribution and top-insight ties, determinism."""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.trading.digest import aggregate, snapshot_key

START = date(2024, 3, 4)  # a Monday
END = date(2024, 3, 11)
MON = datetime(2024, 3, 4, tzinfo=UTC)


def trade(
    id: str, symbol: str, side: str, qty: Any, price: Any, at: datetime | str, fee: Any = 0
) -> dict[str, Any]:
    return {"id": id, "symbol": symbol, "side": side, "qty": qty, "price": price, "fee": fee, "ts": at}


def tag(trade_id: str, label: str, confidence: float, insight: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"trade_id": trade_id, "label": label, "confidence": confidence, "features": {}}
    if insight is not None:
        row["insight"] = insight
    return row


def digest(
    trades: list[dict[str, Any]], tags: list[dict[str, Any]] | None = None, **kw: Any
) -> dict[str, Any]:
    return aggregate(trades, tags or [], period_start=START, period_end=END, **kw)


def at(day: int, hour: int = 10, minute: int = 0) -> datetime:
    return MON + timedelta(days=day, hours=hour, minutes=minute)


WEEK = [
    trade("t1", "BTC-USD", "BUY", 1, 100, at(0, 10), fee=1),  # lot: 101 a unit
    trade("t2", "BTC-USD", "BUY", 1, 110, at(0, 11)),  # lot: 110 a unit
    trade("t3", "BTC-USD", "SELL", Decimal("1.5"), 120, at(1, 9), fee=3),  # 180 - (101 + 55) - 3 = 21
    trade("t4", "ETH-USD", "BUY", 2, 50, at(1, 10)),
    trade("t5", "ETH-USD", "SELL", 2, 40, at(2, 10), fee=2),  # 80 - 100 - 2 = -22
    trade("t6", "BTC-USD", "SELL", Decimal("0.5"), 100, at(3, 9)),  # 50 - 55 = -5
    trade("t7", "ETH-USD", "SELL", 1, 45, at(3, 12)),  # nothing left to close: not a closing trade
]
WEEK_TAGS = [
    tag("t1", "fomo", 0.8),
    tag("t2", "neutral", 0.95, insight="A calm entry."),
    tag("t3", "panic_sell", 0.6),
    tag("t3", "overtrading", 0.9),
    tag("t5", "revenge_trading", 0.7),
]


def test_a_hand_computed_week() -> None:
    assert digest(WEEK, WEEK_TAGS) == {
        "period": {"start": "2024-03-04", "end": "2024-03-11"},
        "trades": 7,
        "by_label": {"fomo": 1, "neutral": 1, "overtrading": 1, "panic_sell": 1, "revenge_trading": 1},
        # t3's 21 goes whole to its highest-confidence label; t6 (-5) is untagged: total only.
        "pnl_by_label": {"overtrading": 21.0, "revenge_trading": -22.0},
        "realized_pnl": -6.0,
        "streaks": {"longest_win": 1, "longest_loss": 2, "current": {"kind": "loss", "length": 2}},
        "active_days": 4,
        "top_insight": {"tradeId": "t2", "label": "neutral", "confidence": 0.95, "text": "A calm entry."},
    }


def test_the_same_rows_in_any_order_give_the_same_json() -> None:
    expected = json.dumps(digest(WEEK, WEEK_TAGS), sort_keys=True)
    rng = random.Random(7)
    for _ in range(20):
        trades, tags = WEEK[:], WEEK_TAGS[:]
        rng.shuffle(trades)
        rng.shuffle(tags)
        assert json.dumps(digest(trades, tags), sort_keys=True) == expected


def test_a_user_without_trades_gets_zeros() -> None:
    assert digest([], [tag("elsewhere", "fomo", 0.9)]) == {
        "period": {"start": "2024-03-04", "end": "2024-03-11"},
        "trades": 0,
        "by_label": {},
        "pnl_by_label": {},
        "realized_pnl": 0.0,
        "streaks": {"longest_win": 0, "longest_loss": 0, "current": {"kind": None, "length": 0}},
        "active_days": 0,
        "top_insight": None,
    }


def test_only_buys_realize_nothing() -> None:
    buys = [trade("b1", "AAPL", "BUY", 3, 180, at(0)), trade("b2", "AAPL", "BUY", 1, 185, at(0, 15))]
    result = digest(buys, [tag("b1", "fomo", 0.7, insight="Chasing the open."), tag("b2", "neutral", 0.6)])
    assert result["trades"] == 2 and result["active_days"] == 1
    assert result["by_label"] == {"fomo": 1, "neutral": 1}
    assert result["pnl_by_label"] == {} and result["realized_pnl"] == 0.0
    assert result["streaks"] == {"longest_win": 0, "longest_loss": 0, "current": {"kind": None, "length": 0}}
    assert result["top_insight"] == {
        "tradeId": "b1",
        "label": "fomo",
        "confidence": 0.7,
        "text": "Chasing the open.",
    }


def test_lots_opened_before_the_window_count_only_when_passed_as_history() -> None:
    sell = [trade("s1", "BTC-USD", "SELL", 1, 130, at(1), fee=1)]
    tags = [tag("s1", "panic_sell", 0.8)]
    unknown = digest(sell, tags)
    assert unknown["realized_pnl"] == 0.0 and unknown["pnl_by_label"] == {}
    assert unknown["streaks"]["current"] == {"kind": None, "length": 0}
    history = [
        trade("h1", "BTC-USD", "BUY", Decimal("0.5"), 100, MON - timedelta(days=3)),
        trade("h2", "BTC-USD", "BUY", 1, 120, MON - timedelta(days=2), fee=2),  # 122 a unit
        trade("h3", "ETH-USD", "BUY", 5, 10, MON - timedelta(days=1)),  # another symbol: unused
    ]
    known = digest(sell, tags, history=history)
    # 130 - (0.5 * 100 + 0.5 * 122) - 1 = 18; history trades are neither counted nor active days.
    assert known["realized_pnl"] == 18.0 and known["pnl_by_label"] == {"panic_sell": 18.0}
    assert known["trades"] == 1 and known["active_days"] == 1
    assert known["streaks"]["current"] == {"kind": "win", "length": 1}


def test_a_partial_lot_and_a_sell_beyond_the_holdings() -> None:
    trades = [
        trade("b", "SOL-USD", "BUY", 2, 10, at(0), fee=Decimal("0.5")),  # 10.25 a unit
        trade("s1", "SOL-USD", "SELL", Decimal("0.5"), 12, at(1)),  # 6 - 5.125 = 0.875
        trade("s2", "SOL-USD", "SELL", 3, 11, at(2), fee=3),  # 1.5 matched: 16.5 - 15.375 - 1.5 = -0.375
        trade("s3", "SOL-USD", "SELL", 1, 11, at(3)),  # nothing left
    ]
    result = digest(trades, [tag("s1", "neutral", 0.5), tag("s2", "neutral", 0.5), tag("s3", "fomo", 0.9)])
    assert result["pnl_by_label"] == {"neutral": 0.5} and result["realized_pnl"] == 0.5
    assert result["streaks"] == {
        "longest_win": 1,
        "longest_loss": 1,
        "current": {"kind": "loss", "length": 1},
    }
    assert result["top_insight"] == {"tradeId": "s3", "label": "fomo", "confidence": 0.9}  # no text


def round_trips(outcomes: str) -> list[dict[str, Any]]:
    """One BUY at 100 and one SELL per outcome (w: 110, l: 90, z: 100), a symbol each, an hour apart."""
    price = {"w": 110, "l": 90, "z": 100}
    rows = []
    for i, outcome in enumerate(outcomes):
        rows.append(trade(f"b{i:02}", f"S{i}", "BUY", 1, 100, at(0, 0, 2 * i)))
        rows.append(trade(f"s{i:02}", f"S{i}", "SELL", 1, price[outcome], at(0, 0, 2 * i + 1)))
    return rows


@pytest.mark.parametrize(
    ("outcomes", "win", "loss", "current"),
    [
        ("w", 1, 0, ("win", 1)),
        ("l", 0, 1, ("loss", 1)),
        ("z", 0, 0, (None, 0)),
        ("wwlwww", 3, 1, ("win", 3)),
        ("wwwlwwll", 3, 2, ("loss", 2)),
        ("wwzw", 2, 0, ("win", 1)),  # a close at 0 ends the run
        ("llz", 0, 2, (None, 0)),
        ("lwlwl", 1, 1, ("loss", 1)),
    ],
)
def test_streak_edges(outcomes: str, win: int, loss: int, current: tuple[str | None, int]) -> None:
    streaks = digest(round_trips(outcomes))["streaks"]
    assert streaks == {
        "longest_win": win,
        "longest_loss": loss,
        "current": {"kind": current[0], "length": current[1]},
    }


def test_runs_follow_time_across_symbols_not_input_order() -> None:
    rows = list(reversed(round_trips("wwl")))
    assert digest(rows)["streaks"]["current"] == {"kind": "loss", "length": 1}


def test_attribution_ties_go_to_the_first_label_alphabetically() -> None:
    trades = [trade("b", "X", "BUY", 1, 10, at(0)), trade("s", "X", "SELL", 1, 14, at(1))]
    tags = [tag("s", "revenge_trading", 0.75), tag("s", "overtrading", 0.75), tag("s", "fomo", 0.5)]
    for order in (tags, list(reversed(tags))):
        assert digest(trades, order)["pnl_by_label"] == {"overtrading": 4.0}


def test_top_insight_ties_go_to_the_earliest_trade_then_the_label() -> None:
    trades = [
        trade("z-late", "X", "BUY", 1, 10, at(2)),
        trade("a-early", "X", "BUY", 1, 10, at(1)),
        trade("m-same-ts", "Y", "BUY", 1, 10, at(1)),  # same time as a-early: the id decides
    ]
    tags = [
        tag("z-late", "fomo", 0.9, insight="late"),
        tag("m-same-ts", "fomo", 0.9, insight="same time, later id"),
        tag("a-early", "overtrading", 0.9, insight="overtrading"),
        tag("a-early", "fomo", 0.9, insight="fomo"),
        tag("a-early", "neutral", 0.2),
    ]
    for _ in range(10):
        random.shuffle(tags)
        top = digest(trades, tags)["top_insight"]
        assert top == {"tradeId": "a-early", "label": "fomo", "confidence": 0.9, "text": "fomo"}


def test_tags_of_trades_outside_the_window_rows_are_ignored() -> None:
    result = digest(
        [trade("t", "X", "BUY", 1, 10, at(0))], [tag("t", "fomo", 0.5), tag("other", "neutral", 1.0)]
    )
    assert result["by_label"] == {"fomo": 1}
    assert result["top_insight"] == {"tradeId": "t", "label": "fomo", "confidence": 0.5}


def test_window_edges_utc_days_and_row_forms() -> None:
    trades = [
        # The first instant of the window, as an ISO string; the numbers as the broker's strings.
        trade("first", "X", "BUY", "0.3", "0.1", "2024-03-04T00:00:00Z"),
        # Naive: UTC. 23:59 on Sunday is still the window, and another UTC day.
        trade("last", "X", "SELL", "0.3", "0.2", datetime(2024, 3, 10, 23, 59, 59)),
        # 01:00 on the 5th in UTC+2 is 23:00 UTC on the 4th.
        trade("offset", "Y", "buy", 1, 1, datetime.fromisoformat("2024-03-05T01:00:00+02:00")),
    ]
    result = digest(trades)
    assert result["realized_pnl"] == 0.03  # exact in decimals, not 0.030000000000000006
    assert result["active_days"] == 2  # the 4th (first, and offset at 23:00 UTC), the 10th
    assert result["streaks"]["current"] == {"kind": "win", "length": 1}


def test_floats_are_rounded_to_8_decimals_and_never_negative_zero() -> None:
    trades = [
        trade("b", "X", "BUY", 3, 1, at(0)),
        trade("s", "X", "SELL", 3, Decimal("1.0000000012"), at(1)),  # 3.6e-9: rounds to 0
        trade("b2", "Y", "BUY", 3, Decimal("1.0000000012"), at(2)),
        trade("s2", "Y", "SELL", 3, 1, at(3)),  # -3.6e-9: rounds to 0, not -0.0
        trade("b3", "Z", "BUY", 3, 1, at(4)),
        trade("s3", "Z", "SELL", 1, Decimal("1.123456789"), at(5)),
    ]
    result = digest(trades, [tag("s2", "neutral", 0.3333333333333)])
    assert json.dumps(result["pnl_by_label"]) == '{"neutral": 0.0}'
    assert result["realized_pnl"] == 0.12345679
    assert result["top_insight"]["confidence"] == 0.33333333
    # Both near-zero closes are neither wins nor losses: they end runs.
    assert result["streaks"] == {"longest_win": 1, "longest_loss": 0, "current": {"kind": "win", "length": 1}}


@pytest.mark.parametrize(
    ("trades", "history", "message"),
    [
        ([trade("t", "X", "BUY", 1, 1, MON - timedelta(seconds=1))], [], "outside"),
        ([trade("t", "X", "BUY", 1, 1, datetime(2024, 3, 11, tzinfo=UTC))], [], "outside"),
        ([], [trade("h", "X", "BUY", 1, 1, MON)], "not before"),
        ([trade("t", "X", "BUY", 1, 1, at(0)), trade("t", "X", "BUY", 1, 1, at(1))], [], "unique"),
        ([trade("t", "X", "BUY", 1, 1, at(0))], [trade("t", "X", "BUY", 1, 1, MON - timedelta(1))], "unique"),
        ([trade("t", "X", "HOLD", 1, 1, at(0))], [], "side"),
        ([trade("t", "X", "BUY", 0, 1, at(0))], [], "qty > 0"),
        ([trade("t", "X", "BUY", "abc", 1, at(0))], [], "decimal"),
        ([trade("t", "X", "BUY", True, 1, at(0))], [], "number"),
        ([trade("t", "X", "BUY", 1, 1, "yesterday")], [], "ISO 8601"),
        ([{"id": "t", "symbol": "X"}], [], "lacks 'side'"),
    ],
)
def test_bad_rows_are_a_callers_bug(
    trades: list[dict[str, Any]], history: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        digest(trades, history=history)


def test_bad_periods_and_tags() -> None:
    with pytest.raises(ValueError, match="end after"):
        aggregate([], [], period_start=END, period_end=END)
    with pytest.raises(ValueError, match="confidence"):
        digest([trade("t", "X", "BUY", 1, 1, at(0))], [tag("t", "fomo", float("nan"))])
    with pytest.raises(ValueError, match="lacks 'label'"):
        digest([], [{"trade_id": "t", "confidence": 0.5}])


def test_snapshot_key() -> None:
    assert snapshot_key("u.1", START, END) == "digests/u.1/2024-03-04-2024-03-11.json"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # symbol
            st.booleans(),  # buy?
            st.integers(1, 5),  # qty
            st.integers(1, 200),  # price
            st.sampled_from(["fomo", "panic_sell", "neutral"]),
            st.integers(0, 10),  # confidence in tenths
        ),
        max_size=30,
    )
)
def test_labels_share_the_total_when_every_trade_is_tagged(
    rows: list[tuple[int, bool, int, int, str, int]],
) -> None:
    trades = [
        trade(f"t{i:02}", f"S{symbol}", "BUY" if buy else "SELL", qty, price, at(i % 7, i % 24, i))
        for i, (symbol, buy, qty, price, _, _) in enumerate(rows)
    ]
    tags = [tag(f"t{i:02}", label, tenths / 10) for i, (*_, label, tenths) in enumerate(rows)]
    result = digest(trades, tags)
    assert sum(result["pnl_by_label"].values()) == pytest.approx(result["realized_pnl"], abs=1e-6)
    assert sum(result["by_label"].values()) == result["trades"] == len(rows)
    streaks = result["streaks"]
    assert 0 <= streaks["current"]["length"] <= max(streaks["longest_win"], streaks["longest_loss"])
    assert result["active_days"] <= min(len(rows), 7)
    json.dumps(result, allow_nan=False)
