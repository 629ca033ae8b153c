"""normalize(): both brokers' rows, every reject reason, and no reason ever quoting the row."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.trading.normalize import REASONS, Rejected, Trade, normalize


def coinbase_row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "trade_id": "cb-1",
        "product_id": "BTC-USD",
        "side": "buy",
        "size": "0.5",
        "price": "43000.1",
        "fee": "0.2",
        "created_at": "2024-03-01T10:00:00Z",
    }
    row.update(changes)
    return row


def binance_row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": 28457,
        "symbol": "BTCUSDT",
        "isBuyer": True,
        "qty": "0.012",
        "price": "61000.5",
        "commission": "0.00001",
        "time": 1709287200000,  # 2024-03-01T10:00:00Z
    }
    row.update(changes)
    return row


def without(row: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != key}


def rejected(broker: str, row: object) -> Rejected:
    result = normalize(broker, row)  # type: ignore[arg-type]
    assert isinstance(result, Rejected), result
    assert result.reason in REASONS
    return result


def test_coinbase_row_with_strings() -> None:
    assert normalize("coinbase", coinbase_row()) == Trade(
        ext_id="cb-1",
        symbol="BTC-USD",
        side="BUY",
        qty=Decimal("0.5"),
        price=Decimal("43000.1"),
        fee=Decimal("0.2"),
        ts=datetime(2024, 3, 1, 10, tzinfo=UTC),
    )


def test_coinbase_row_with_json_numbers_and_sell() -> None:
    row = coinbase_row(side="SELL", size=0.1, price=43000, fee=0.25)
    trade = normalize("coinbase", json.loads(json.dumps(row)))
    assert isinstance(trade, Trade)
    assert (trade.side, trade.qty, trade.price, trade.fee) == (
        "SELL",
        Decimal("0.1"),
        Decimal(43000),
        Decimal("0.25"),
    )


def test_binance_row_with_strings_and_numbers() -> None:
    trade = normalize("binance", binance_row())
    assert trade == Trade(
        ext_id="28457",
        symbol="BTCUSDT",
        side="BUY",
        qty=Decimal("0.012"),
        price=Decimal("61000.5"),
        fee=Decimal("0.00001"),
        ts=datetime(2024, 3, 1, 10, tzinfo=UTC),
    )
    trade = normalize(
        "binance", binance_row(isBuyer=False, qty=2, price=1.5, commission=0, time=1709287200000.0)
    )
    assert isinstance(trade, Trade)
    assert (trade.side, trade.qty, trade.price, trade.fee) == ("SELL", Decimal(2), Decimal("1.5"), Decimal(0))
    assert trade.ts == datetime(2024, 3, 1, 10, tzinfo=UTC)


def test_numbers_in_exponent_and_signed_notation() -> None:
    trade = normalize("coinbase", coinbase_row(size="1e-3", price="+4.3E4", fee=" 0.20 "))
    assert isinstance(trade, Trade)
    assert (trade.qty, trade.price, trade.fee) == (Decimal("0.001"), Decimal(43000), Decimal("0.2"))


@pytest.mark.parametrize(("broker", "key"), [("coinbase", "fee"), ("binance", "commission")])
def test_absent_or_null_fee_is_zero(broker: str, key: str) -> None:
    row = coinbase_row() if broker == "coinbase" else binance_row()
    for candidate in (without(row, key), {**row, key: None}):
        trade = normalize(broker, candidate)  # type: ignore[arg-type]
        assert isinstance(trade, Trade)
        assert trade.fee == 0


@pytest.mark.parametrize(
    ("created_at", "expected"),
    [
        ("2024-03-01T10:00:00Z", datetime(2024, 3, 1, 10, tzinfo=UTC)),
        ("2024-03-01T12:30:00+02:30", datetime(2024, 3, 1, 10, tzinfo=UTC)),
        ("2024-03-01T05:00:00-05:00", datetime(2024, 3, 1, 10, tzinfo=UTC)),
        ("2024-03-01T10:00:00", datetime(2024, 3, 1, 10, tzinfo=UTC)),
        ("2024-03-01T10:00:00.123456Z", datetime(2024, 3, 1, 10, 0, 0, 123456, tzinfo=UTC)),
        ("2024-03-01 10:00:00+00:00", datetime(2024, 3, 1, 10, tzinfo=UTC)),
        ("2000-01-01T00:00:00Z", datetime(2000, 1, 1, tzinfo=UTC)),
        ("2100-12-31T23:59:59Z", datetime(2100, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_coinbase_times_become_aware_utc(created_at: str, expected: datetime) -> None:
    trade = normalize("coinbase", coinbase_row(created_at=created_at))
    assert isinstance(trade, Trade)
    assert trade.ts == expected
    assert trade.ts.utcoffset() is not None and trade.ts.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("created_at", "reason"),
    [
        ("yesterday", "created_at is not a valid timestamp"),
        ("2024-13-01T00:00:00Z", "created_at is not a valid timestamp"),
        ("2024-03-01T10:00:00+25:00", "created_at is not a valid timestamp"),
        ("", "created_at is not a valid timestamp"),
        (1709287200, "created_at is not a valid timestamp"),
        (["2024-03-01"], "created_at is not a valid timestamp"),
        ("2024-03-01T10:00:00Z" + " " * 80, "created_at is not a valid timestamp"),
        ("1999-12-31T23:59:59Z", "created_at is out of range"),
        ("2101-01-01T00:00:00Z", "created_at is out of range"),
        ("2100-12-31T23:00:00-05:00", "created_at is out of range"),  # 2101 in UTC
        ("2000-01-01T00:30:00+01:00", "created_at is out of range"),  # 1999 in UTC
        ("0001-01-01T00:00:00+01:00", "created_at is out of range"),  # would overflow astimezone()
        ("9999-12-31T23:59:59-01:00", "created_at is out of range"),
    ],
)
def test_coinbase_bad_times(created_at: object, reason: str) -> None:
    result = rejected("coinbase", coinbase_row(created_at=created_at))
    assert result == Rejected("cb-1", reason)


@pytest.mark.parametrize(
    ("time", "reason"),
    [
        ("1709287200000", "time is not a valid timestamp"),
        (True, "time is not a valid timestamp"),
        (1709287200000.5, "time is not a valid timestamp"),
        (math.nan, "time is not a valid timestamp"),
        (math.inf, "time is not a valid timestamp"),
        (None, "time missing"),
        (946684800000 - 1, "time is out of range"),  # 1999-12-31T23:59:59.999Z
        (4133980800000, "time is out of range"),  # 2101-01-01
        (-1, "time is out of range"),
        (10**400, "time is out of range"),
        (1709287200, "time is out of range"),  # seconds, not milliseconds: 1970
    ],
)
def test_binance_bad_times(time: object, reason: str) -> None:
    assert rejected("binance", binance_row(time=time)) == Rejected("28457", reason)


def test_binance_time_bounds() -> None:
    first = normalize("binance", binance_row(time=946684800000))
    last = normalize("binance", binance_row(time=4133980800000 - 1))
    assert isinstance(first, Trade) and first.ts == datetime(2000, 1, 1, tzinfo=UTC)
    assert isinstance(last, Trade) and last.ts.year == 2100


@pytest.mark.parametrize("row", [None, [], [1, 2], "row", 3, 2.5, True])
@pytest.mark.parametrize("broker", ["coinbase", "binance"])
def test_row_not_an_object(broker: str, row: object) -> None:
    assert rejected(broker, row) == Rejected(None, "row is not an object")


@pytest.mark.parametrize(
    ("value", "ext_id", "reason"),
    [
        (7, "7", None),
        (-7, "-7", None),
        (10**99, "1" + "0" * 99, None),
        ("x" * 100, "x" * 100, None),
        ("abc-DEF_1", "abc-DEF_1", None),
        (None, None, "trade_id missing"),
        (True, None, "trade_id is not a string or an integer"),
        (1.5, None, "trade_id is not a string or an integer"),
        ({"a": 1}, None, "trade_id is not a string or an integer"),
        ("", None, "trade_id is empty or not printable"),
        ("   ", None, "trade_id is empty or not printable"),
        ("a\x00b", None, "trade_id is empty or not printable"),
        ("a\nb", None, "trade_id is empty or not printable"),
        ("\ud800", None, "trade_id is empty or not printable"),
        ("x" * 101, None, "trade_id is too long"),
        (10**100, None, "trade_id is too long"),
        (10**5000, None, "trade_id is too long"),
    ],
    ids=lambda value: repr(value)[:20] if not isinstance(value, int) else f"int{value.bit_length()}",
)
def test_coinbase_ids(value: object, ext_id: str | None, reason: str | None) -> None:
    result = normalize("coinbase", coinbase_row(trade_id=value))
    if reason is None:
        assert isinstance(result, Trade) and result.ext_id == ext_id
    else:
        assert result == Rejected(None, reason)


def test_binance_ids_and_missing_id() -> None:
    assert rejected("binance", without(binance_row(), "id")) == Rejected(None, "id missing")
    assert rejected("binance", binance_row(id=False)) == Rejected(None, "id is not a string or an integer")
    trade = normalize("binance", binance_row(id="b-9"))
    assert isinstance(trade, Trade) and trade.ext_id == "b-9"


def test_id_is_kept_when_a_later_field_fails() -> None:
    assert rejected("coinbase", coinbase_row(trade_id=42, price=None)) == Rejected("42", "price missing")


@pytest.mark.parametrize(
    ("symbol", "ok"),
    [
        ("BTC-USD", True),
        ("BRK.B", True),
        ("EUR/USD", True),
        ("s_1", True),
        ("X" * 40, True),
        ("X" * 41, False),
        ("", False),
        ("BTC USD", False),
        ("BTC-USD\n", False),
        ("ÄPFEL", False),
        ("<script>", False),
        (5, False),
        (["BTC-USD"], False),
    ],
)
def test_symbols(symbol: object, ok: bool) -> None:
    result = normalize("coinbase", coinbase_row(product_id=symbol))
    if ok:
        assert isinstance(result, Trade) and result.symbol == symbol
    else:
        assert result == Rejected("cb-1", "product_id is not a valid symbol")


def test_missing_symbol_both_brokers() -> None:
    assert rejected("coinbase", without(coinbase_row(), "product_id")).reason == "product_id missing"
    assert rejected("binance", without(binance_row(), "symbol")).reason == "symbol missing"
    assert rejected("binance", binance_row(symbol="")).reason == "symbol is not a valid symbol"


@pytest.mark.parametrize("side", ["BUY", "Sell", "buy", "sell"])
def test_coinbase_sides_any_case(side: str) -> None:
    result = normalize("coinbase", coinbase_row(side=side))
    assert isinstance(result, Trade) and result.side == side.upper()


@pytest.mark.parametrize(("broker", "value"), [("coinbase", "hold"), ("coinbase", 1), ("coinbase", True)])
def test_coinbase_unknown_side(broker: str, value: object) -> None:
    assert rejected(broker, coinbase_row(side=value)) == Rejected("cb-1", "unknown side")


@pytest.mark.parametrize("value", ["true", 1, 0, "BUY"])
def test_binance_unknown_side(value: object) -> None:
    assert rejected("binance", binance_row(isBuyer=value)) == Rejected("28457", "unknown side")


def test_missing_side_both_brokers() -> None:
    assert rejected("coinbase", without(coinbase_row(), "side")).reason == "side missing"
    assert rejected("binance", without(binance_row(), "isBuyer")).reason == "isBuyer missing"


NOT_NUMBERS = [
    "abc",
    "",
    "NaN",
    "nan",
    "Infinity",
    "-inf",
    "1_000",
    "0x10",
    "1,5",
    "1.2.3",
    "1e99999",
    "5" * 65,
]
NOT_NUMBERS_JSON: list[object] = [True, False, [], {}, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", NOT_NUMBERS + NOT_NUMBERS_JSON)
@pytest.mark.parametrize(
    ("broker", "field"),
    [
        ("coinbase", "size"),
        ("coinbase", "price"),
        ("coinbase", "fee"),
        ("binance", "qty"),
        ("binance", "price"),
        ("binance", "commission"),
    ],
)
def test_not_a_number(broker: str, field: str, value: object) -> None:
    row = coinbase_row(**{field: value}) if broker == "coinbase" else binance_row(**{field: value})
    assert rejected(broker, row).reason == f"{field} is not a number"


@pytest.mark.parametrize(
    ("broker", "field", "value", "reason"),
    [
        ("coinbase", "size", None, "size missing"),
        ("coinbase", "size", "0", "size must be > 0"),
        ("coinbase", "size", 0, "size must be > 0"),
        ("coinbase", "size", "-0.5", "size must be > 0"),
        ("coinbase", "size", -(10**200), "size must be > 0"),
        ("coinbase", "size", "1e18", "size is out of range"),
        ("coinbase", "size", 10**200, "size is out of range"),
        ("coinbase", "size", "1e-19", "size is out of range"),
        ("coinbase", "price", None, "price missing"),
        ("coinbase", "price", "0.0", "price must be > 0"),
        ("coinbase", "price", -1.5, "price must be > 0"),
        ("coinbase", "fee", "-0.01", "fee must be >= 0"),
        ("coinbase", "fee", 1e20, "fee is out of range"),
        ("binance", "qty", None, "qty missing"),
        ("binance", "qty", "0", "qty must be > 0"),
        ("binance", "price", -3, "price must be > 0"),
        ("binance", "commission", -0.1, "commission must be >= 0"),
    ],
)
def test_number_rules(broker: str, field: str, value: object, reason: str) -> None:
    row = coinbase_row(**{field: value}) if broker == "coinbase" else binance_row(**{field: value})
    assert rejected(broker, row).reason == reason


def test_missing_price_field_entirely() -> None:
    assert rejected("coinbase", without(coinbase_row(), "price")) == Rejected("cb-1", "price missing")
    assert rejected("binance", without(binance_row(), "qty")) == Rejected("28457", "qty missing")
    assert rejected("coinbase", without(coinbase_row(), "created_at")).reason == "created_at missing"


def test_zero_fee_is_fine() -> None:
    trade = normalize("coinbase", coinbase_row(fee="0"))
    assert isinstance(trade, Trade) and trade.fee == 0


def test_first_failure_wins_in_field_order() -> None:
    row = coinbase_row(product_id="", side="?", size="x", price=None, created_at="never")
    assert rejected("coinbase", row).reason == "product_id is not a valid symbol"
    assert rejected("coinbase", {**row, "product_id": "ETH-USD"}).reason == "unknown side"


def test_unknown_broker_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown broker"):
        normalize("kraken", coinbase_row())  # type: ignore[arg-type]


def test_reasons_are_fixed_phrases() -> None:
    assert "price missing" in REASONS
    assert "size is not a number" in REASONS
    assert "size must be > 0" in REASONS
    assert "unknown side" in REASONS
    assert "row is not an object" in REASONS
    assert all(len(reason) <= 60 for reason in REASONS)


CANARY = "CANARY-7f3a"


@pytest.mark.parametrize("broker", ["coinbase", "binance"])
def test_no_reason_quotes_the_row(broker: str) -> None:
    base = coinbase_row() if broker == "coinbase" else binance_row()
    for key in base:
        for value in (CANARY, f"1{CANARY}", [CANARY], {CANARY: CANARY}, f"2024-01-01T{CANARY}"):
            result = normalize(broker, {**base, key: value})  # type: ignore[arg-type]
            if isinstance(result, Rejected):
                assert CANARY not in result.reason
                assert result.reason in REASONS


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=12,
)


def _field_values() -> st.SearchStrategy[object]:
    return JSON | st.sampled_from(
        ["buy", "sell", "0.5", "-1", "1e5", "BTC-USD", "2024-03-01T10:00:00Z", "2024-03-01", 1709287200000]
    )


@settings(max_examples=400, deadline=None)
@given(broker=st.sampled_from(["coinbase", "binance"]), row=JSON)
def test_never_raises_on_any_json_value(broker: str, row: object) -> None:
    result = normalize(broker, row)  # type: ignore[arg-type]
    assert isinstance(result, Trade | Rejected)
    if isinstance(result, Rejected):
        assert result.reason in REASONS


@settings(max_examples=600, deadline=None)
@given(broker=st.sampled_from(["coinbase", "binance"]), data=st.data())
def test_never_raises_on_near_miss_rows(broker: str, data: st.DataObject) -> None:
    base = coinbase_row() if broker == "coinbase" else binance_row()
    keys = data.draw(st.lists(st.sampled_from(sorted(base)), unique=True, max_size=3))
    row = dict(base)
    for key in keys:
        if data.draw(st.booleans()):
            row[key] = data.draw(_field_values())
        else:
            del row[key]
    result = normalize(broker, row)  # type: ignore[arg-type]
    if isinstance(result, Rejected):
        assert result.reason in REASONS
        assert result.ext_id is None or (isinstance(result.ext_id, str) and len(result.ext_id) <= 100)
    else:
        assert result.qty > 0 and result.price > 0 and result.fee >= 0
        assert result.ts.tzinfo is not None and 2000 <= result.ts.year <= 2100
        assert result.side in ("BUY", "SELL")
