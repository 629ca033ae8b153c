"""Turn one broker row (any JSON value, served verbatim) into a :class:`Trade` or a :class:`Rejected`.

Pure: no I/O, never raises on any JSON value (nor on Python floats such as NaN). A row is checked
field by field in this order, and the first failure is the reason:

=============  ==============================  ==================================================
check          coinbase field / binance field  rule
=============  ==============================  ==================================================
object         --                              the row is a JSON object (``dict``)
id             ``trade_id`` / ``id``           a non-empty printable string or an integer (not a
                                               boolean), at most 100 characters once a string
symbol         ``product_id`` / ``symbol``     a string of 1..40 characters of ``[A-Za-z0-9._/-]``
                                               kept as is (``BTC-USD``, ``BTCUSDT``)
side           ``side`` / ``isBuyer``          ``"buy"``/``"sell"`` (any case) / a JSON boolean
qty            ``size`` / ``qty``              a finite decimal > 0, within 1e-18 .. 1e18
price          ``price`` / ``price``           a finite decimal > 0, within 1e-18 .. 1e18
fee            ``fee`` / ``commission``        absent or null → 0; else 0 or a finite decimal
                                               within 1e-18 .. 1e18
time           ``created_at`` / ``time``       ISO-8601 (``Z``, an offset, or naive = UTC) /
                                               epoch milliseconds (an integer, or a float with
                                               no fraction); the UTC year within 2000..2100
=============  ==============================  ==================================================

Numbers may be JSON numbers or strings; a string must be plain decimal notation (``"43000.1"``,
``"-2"``, ``"1e-3"``): no ``NaN``/``Infinity``, no ``_`` separators, at most 64 characters. JSON
booleans are never numbers. A binance ``commission`` may be in another asset than the quote one;
it is taken as the fee as is (v1).

A :class:`Rejected` reason is one of :data:`REASONS`: a short phrase naming the field and never
quoting the row, so it is safe to store and to log. Its ``ext_id`` is the row's id when the row got
far enough to have a usable one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Literal

__all__ = ["REASONS", "Broker", "Rejected", "Trade", "normalize"]

Broker = Literal["coinbase", "binance"]

MAX_ID_CHARS = 100
MAX_SYMBOL_CHARS = 40
MAX_NUMBER_CHARS = 64
MAX_TIME_CHARS = 64
MIN_YEAR, MAX_YEAR = 2000, 2100
# Well inside a NUMERIC column and a float; a quantity or price beyond is a broken row, not a trade.
NUMBER_LIMIT = Decimal("1e18")
NUMBER_FLOOR = Decimal("1e-18")

_SYMBOL = re.compile(r"[A-Za-z0-9._/-]{1,40}")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MIN_MS = int((datetime(MIN_YEAR, 1, 1, tzinfo=UTC) - _EPOCH).total_seconds() * 1000)
_MAX_MS = int((datetime(MAX_YEAR + 1, 1, 1, tzinfo=UTC) - _EPOCH).total_seconds() * 1000) - 1


@dataclass(frozen=True)
class _Fields:
    id: str
    symbol: str
    side: str
    qty: str
    price: str
    fee: str
    time: str


_FIELDS: dict[str, _Fields] = {
    "coinbase": _Fields("trade_id", "product_id", "side", "size", "price", "fee", "created_at"),
    "binance": _Fields("id", "symbol", "isBuyer", "qty", "price", "commission", "time"),
}


@dataclass(frozen=True)
class Trade:
    """A broker row, normalized."""

    ext_id: str
    symbol: str  # coinbase product_id "BTC-USD" as is; binance symbol "BTCUSDT" as is
    side: Literal["BUY", "SELL"]
    qty: Decimal  # > 0
    price: Decimal  # > 0
    fee: Decimal  # >= 0, 0 when absent
    ts: datetime  # aware UTC


@dataclass(frozen=True)
class Rejected:
    """A row that is not a trade: why (one of :data:`REASONS`), and its id when it had a usable one."""

    ext_id: str | None
    reason: str


def _reasons() -> frozenset[str]:
    reasons = {"row is not an object", "unknown side"}
    for fields in _FIELDS.values():
        reasons |= {
            f"{fields.id} missing",
            f"{fields.id} is not a string or an integer",
            f"{fields.id} is empty or not printable",
            f"{fields.id} is too long",
            f"{fields.symbol} missing",
            f"{fields.symbol} is not a valid symbol",
            f"{fields.side} missing",
            f"{fields.time} missing",
            f"{fields.time} is not a valid timestamp",
            f"{fields.time} is out of range",
        }
        for name in (fields.qty, fields.price, fields.fee):
            reasons |= {f"{name} missing", f"{name} is not a number", f"{name} is out of range"}
        reasons |= {f"{fields.qty} must be > 0", f"{fields.price} must be > 0", f"{fields.fee} must be >= 0"}
    return frozenset(reasons)


#: Every reason :func:`normalize` can give (both brokers).
REASONS: frozenset[str] = _reasons()


class _Reject(Exception):
    """Internal: the first failed check, carrying its fixed reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def normalize(broker: Broker, row: object) -> Trade | Rejected:
    """Normalize one ``broker`` row (any JSON value) into a :class:`Trade`, or say why not.

    Never raises for a row; an unknown ``broker`` is a programming error (``ValueError``).
    """
    fields = _FIELDS.get(broker)
    if fields is None:
        raise ValueError("unknown broker")
    if not isinstance(row, dict):
        return Rejected(None, "row is not an object")
    try:
        ext_id = _ext_id(row, fields.id)
    except _Reject as rejected:
        return Rejected(None, rejected.reason)
    try:
        symbol = _symbol(row, fields.symbol)
        side = _coinbase_side(row, fields.side) if broker == "coinbase" else _binance_side(row, fields.side)
        qty = _number(row, fields.qty, positive=True)
        price = _number(row, fields.price, positive=True)
        fee = _number(row, fields.fee, positive=False) if row.get(fields.fee) is not None else Decimal(0)
        ts = _iso_time(row, fields.time) if broker == "coinbase" else _epoch_ms_time(row, fields.time)
    except _Reject as rejected:
        return Rejected(ext_id, rejected.reason)
    return Trade(ext_id=ext_id, symbol=symbol, side=side, qty=qty, price=price, fee=fee, ts=ts)


def _ext_id(row: dict[object, object], name: str) -> str:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _Reject(f"{name} is not a string or an integer")
    if isinstance(value, int):
        # Checked before str(): a huge JSON integer would hit the int-to-str digit limit.
        if abs(value).bit_length() > 4 * MAX_ID_CHARS:
            raise _Reject(f"{name} is too long")
        value = str(value)
    if len(value) > MAX_ID_CHARS:
        raise _Reject(f"{name} is too long")
    # Control characters (NUL above all) and lone surrogates cannot be stored in a Postgres text column.
    if not value.strip() or not value.isprintable():
        raise _Reject(f"{name} is empty or not printable")
    return value


def _symbol(row: dict[object, object], name: str) -> str:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if not isinstance(value, str) or len(value) > MAX_SYMBOL_CHARS or not _SYMBOL.fullmatch(value):
        raise _Reject(f"{name} is not a valid symbol")
    return value


def _coinbase_side(row: dict[object, object], name: str) -> Literal["BUY", "SELL"]:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if isinstance(value, str):
        if value.lower() == "buy":
            return "BUY"
        if value.lower() == "sell":
            return "SELL"
    raise _Reject("unknown side")


def _binance_side(row: dict[object, object], name: str) -> Literal["BUY", "SELL"]:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if not isinstance(value, bool):
        raise _Reject("unknown side")
    return "BUY" if value else "SELL"


def _number(row: dict[object, object], name: str, *, positive: bool) -> Decimal:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    number = _decimal(value)
    if number is None:
        raise _Reject(f"{name} is not a number")
    if positive and number <= 0:
        raise _Reject(f"{name} must be > 0")
    if not positive and number < 0:
        raise _Reject(f"{name} must be >= 0")
    if number >= NUMBER_LIMIT or 0 < number < NUMBER_FLOOR:
        raise _Reject(f"{name} is out of range")
    return number


def _decimal(value: object) -> Decimal | None:
    """A finite Decimal from a JSON number or a plain decimal string, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value).bit_length() > 80:  # beyond any limit; avoids str() of a huge integer
            return Decimal("1e30") if value > 0 else Decimal("-1e30")
        return Decimal(value)
    if isinstance(value, float):
        # repr() gives the shortest string that round-trips: 0.1 stays 0.1, not its binary expansion.
        return Decimal(repr(value)) if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_NUMBER_CHARS or not _DECIMAL.fullmatch(text):
            return None
        try:
            return Decimal(text)
        except InvalidOperation:
            return None
    return None


def _iso_time(row: dict[object, object], name: str) -> datetime:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if not isinstance(value, str) or len(value) > MAX_TIME_CHARS:
        raise _Reject(f"{name} is not a valid timestamp")
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise _Reject(f"{name} is not a valid timestamp") from None
    # The year is checked before the conversion too: astimezone() overflows near year 1 or 9999.
    if not MIN_YEAR - 1 <= parsed.year <= MAX_YEAR + 1:
        raise _Reject(f"{name} is out of range")
    ts = parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    if not MIN_YEAR <= ts.year <= MAX_YEAR:
        raise _Reject(f"{name} is out of range")
    return ts


def _epoch_ms_time(row: dict[object, object], name: str) -> datetime:
    value = row.get(name)
    if value is None:
        raise _Reject(f"{name} missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Reject(f"{name} is not a valid timestamp")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _Reject(f"{name} is not a valid timestamp")
        value = int(value)
    if not _MIN_MS <= value <= _MAX_MS:
        raise _Reject(f"{name} is out of range")
    return _EPOCH + timedelta(milliseconds=value)
