"""The seed's simple model of ``simulate.simple``: one trade, "hold" against "actual" over a
horizon, from the closes of its candles. Pure: no I/O, no clock.

**The question.** What did this trade do for the trader, compared with not making it? Both
curves are the P/L, in the quote currency, of the trader's holdings *from the moment of the
trade* (so both start at 0 before the fee), marked at each candle's close:

- ``hold``: the position as it was before the trade, kept to the horizon (the trade not
  made). For a **SELL**, that is still owning the ``qty`` sold: ``qty * (close - price)``,
  what the seller gave up (or escaped). For a **BUY**, that is not owning the ``qty`` bought:
  ``0`` at every point (cash does not move).
- ``actual``: the trade as executed, then left alone. For a **BUY**, the bought position
  marked to market: ``qty * (close - price) - fee``. For a **SELL**, the proceeds are cash:
  ``-fee`` at every point.

``delta = hold[-1] - actual[-1]`` (the seed's ``holdPnL - actualPnL``): what not trading
would have made beyond the trade, at the horizon. Positive: the trade cost money (a SELL
before a rise, a BUY before a fall, or a fee on a flat market); negative: it paid off. In one
formula, with ``c`` the last close: ``delta = s * qty * (c - price) + fee``, ``s = +1`` for a
SELL and ``-1`` for a BUY.

**The points.** The first is the trade itself, at ``ts`` (``hold`` 0, ``actual`` ``-fee``).
Then one per candle whose close falls in ``(ts, end]``: a candle starting at ``t`` closes at
``t + step`` (one hour by default), the point's time. So the caller fetches the candles from
``ts`` rounded down to the hour: the candle the trade was made in closes after it and is the
first point. Candles closing at or before ``ts`` or after ``end`` are ignored; their order
does not matter. With no candle in the window the curves are the first point alone.

``partial`` is true when the candles stop before ``end``: the last point is a ``step`` or more
before it, so a candle closing by ``end`` is missing (a window without candles, a vendor that
answered part of it). A stock's closed market at the end (a weekend) reads as partial too:
candles alone cannot tell closed from missing. P/L values and ``delta`` are rounded to 6 decimals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from tasks.trading.series import Candle

__all__ = ["DECIMALS", "SIDES", "simulate"]

SIDES = ("BUY", "SELL")
DECIMALS = 6
_HOUR = timedelta(hours=1)


def simulate(
    side: str,
    qty: float,
    price: float,
    fee: float,
    ts: datetime,
    candles: Iterable[Candle],
    *,
    end: datetime,
    step: timedelta = _HOUR,
) -> dict[str, Any]:
    """The hold and actual curves of one trade (``side`` ``BUY`` or ``SELL``, any case;
    ``qty`` and ``price`` > 0, ``fee`` >= 0, at ``ts``) over ``candles`` up to ``end``; see
    the module's docstring for the model. Naive datetimes are UTC.

    Returns ``{"t": [ISO-8601, ...], "actual": [...], "hold": [...], "delta", "end", "partial"}``.
    Raises ``ValueError`` on a bad side, a non-finite or out-of-range number, an ``end``
    before ``ts`` or a non-positive ``step``."""
    sign = _sign(side)
    _check(qty, "qty", positive=True)
    _check(price, "price", positive=True)
    _check(fee, "fee", positive=False)
    if step <= timedelta(0):
        raise ValueError("step must be positive")
    start, end = _utc(ts), _utc(end)
    if end < start:
        raise ValueError("end must not be before ts")
    closes = sorted(
        (closed, candle.c)
        for candle in candles
        if start < (closed := _utc(candle.t) + step) <= end and math.isfinite(candle.c)
    )
    times, hold, actual = [start], [0.0], [-fee]
    for closed, close in closes:
        moved = qty * (close - price)
        times.append(closed)
        if sign > 0:  # SELL: holding is keeping the qty; the trade left cash
            hold.append(moved)
            actual.append(-fee)
        else:  # BUY: holding is staying in cash; the trade bought the qty
            hold.append(0.0)
            actual.append(moved - fee)
    return {
        "t": [_iso(moment) for moment in times],
        "actual": [_round(x) for x in actual],
        "hold": [_round(x) for x in hold],
        "delta": _round(hold[-1] - actual[-1]),
        "end": _iso(end),
        "partial": end - times[-1] >= step,
    }


def _sign(side: str) -> int:
    upper = side.upper() if isinstance(side, str) else ""
    if upper not in SIDES:
        raise ValueError(f"side must be one of {', '.join(SIDES)}")
    return 1 if upper == "SELL" else -1


def _check(value: float, name: str, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}")


def _round(value: float) -> float:
    rounded = round(value, DECIMALS)
    return 0.0 if rounded == 0 else rounded  # no "-0.0" in the answer


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
