"""Hourly OHLCV candles and the numbers read from them: the window before a trade, its sparkline, and
the local indicators.

Pure Python (no numpy): the AI coach peer imports :func:`local_indicators` to answer
``/v1/indicators``, so a stage computing them locally gets the very same numbers.

The window of a trade at ``ts`` is the last ``hours`` candles whose start ``t`` is at or before
``ts`` (:func:`window_before`): counted in candles, not in wall-clock hours, so a stock's window on
a Monday morning reaches back into Friday instead of being empty over the weekend. The indicators,
over the 48-candle window (the last candle is "now"):

==================  ===============================================================================
``rsi_14``          Wilder's RSI(14) of the closes, 0..100 (100 with no down move, 50 when flat);
                    needs 15 closes
``return_24h``      ``close[-1] / close[-25] - 1``: a fraction (0.05 is +5 %); needs 25 closes
``volatility_24h``  sample standard deviation of the last 24 hourly log returns (fewer when the
                    window is shorter); needs 3 closes
``volume_z``        ``(volume[-1] - mean) / std`` over the window's volumes (population std);
                    needs 2 candles and some spread
``drawdown_24h``    ``1 - close[-1] / max(high of the last 24 candles)``: how far below its 24 h
                    peak the price is, a fraction >= 0
``candles``         how many candles the window holds (0..48), so a reader can tell "no data"
                    from a real 0
==================  ===============================================================================

Missing data (too few candles, a non-positive or non-finite price) gives 0.0 for that indicator;
all values are rounded to 6 decimals.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

__all__ = ["INDICATOR_KEYS", "WINDOW_HOURS", "Candle", "local_indicators", "spark", "window_before"]

WINDOW_HOURS = 48
RSI_PERIOD = 14
DAY_CANDLES = 24
INDICATOR_KEYS = ("rsi_14", "return_24h", "volatility_24h", "volume_z", "drawdown_24h", "candles")


@dataclass(frozen=True)
class Candle:
    """One OHLCV bar starting at ``t`` (aware UTC)."""

    t: datetime
    o: float
    h: float
    l: float  # noqa: E741 -- the wire name of the low, shared with the peers' JSON
    c: float
    v: float

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Candle:
        """Read ``{"t": ISO-8601, "o", "h", "l", "c", "v"}``; a naive ``t`` is UTC.

        Raises ``ValueError`` (or ``KeyError``/``TypeError``) on a malformed candle.
        """
        t = d["t"]
        if not isinstance(t, str):
            raise ValueError("candle time is not a string")
        return cls(
            t=_utc(datetime.fromisoformat(t)),
            o=_float(d["o"]),
            h=_float(d["h"]),
            l=_float(d["l"]),
            c=_float(d["c"]),
            v=_float(d["v"]),
        )

    def to_json(self) -> dict[str, Any]:
        """``{"t": "2024-01-01T00:00:00Z", "o", "h", "l", "c", "v"}``."""
        return {
            "t": _utc(self.t).isoformat().replace("+00:00", "Z"),
            "o": self.o,
            "h": self.h,
            "l": self.l,
            "c": self.c,
            "v": self.v,
        }


def window_before(candles: Sequence[Candle], ts: datetime, hours: int = WINDOW_HOURS) -> list[Candle]:
    """The last ``hours`` candles with ``t <= ts``, oldest first (``candles`` in any order)."""
    if hours <= 0:
        return []
    ordered = _sorted(candles)
    end = bisect_right([candle.t for candle in ordered], _utc(ts))
    return list(ordered[max(0, end - hours) : end])


def spark(candles: Sequence[Candle], ts: datetime, points: int = 24) -> list[float]:
    """The closes of the ``points`` candles ending at ``ts``, scaled to 0..1 and rounded to 3 decimals.

    All equal closes give 0.5 each (so does a non-finite close); no candle gives ``[]``.
    """
    closes = [candle.c for candle in window_before(candles, ts, points)]
    if not closes:
        return []
    finite = [close for close in closes if math.isfinite(close)]
    # Halved: the spread of two extreme floats would overflow to inf.
    low = min(finite, default=0.0) / 2
    span = max(finite, default=0.0) / 2 - low
    if span <= 0:
        return [0.5] * len(closes)
    return [
        round(min(1.0, max(0.0, (close / 2 - low) / span)), 3) if math.isfinite(close) else 0.5
        for close in closes
    ]


def local_indicators(candles: Sequence[Candle], ts: datetime) -> dict[str, float]:
    """The indicators of the 48-candle window before ``ts`` (see the module docstring)."""
    window = window_before(candles, ts, WINDOW_HOURS)
    closes = [candle.c for candle in window]
    values = {
        "rsi_14": _rsi(closes, RSI_PERIOD),
        "return_24h": _return(closes, DAY_CANDLES),
        "volatility_24h": _volatility(closes[-(DAY_CANDLES + 1) :]),
        "volume_z": _zscore([candle.v for candle in window]),
        "drawdown_24h": _drawdown(window[-DAY_CANDLES:]),
    }
    result = {key: round(value, 6) if math.isfinite(value) else 0.0 for key, value in values.items()}
    result["candles"] = float(len(window))
    return result


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("candle value is not a number")
    return float(value)


def _sorted(candles: Sequence[Candle]) -> Sequence[Candle]:
    if all(candles[i].t <= candles[i + 1].t for i in range(len(candles) - 1)):
        return candles
    return sorted(candles, key=lambda candle: candle.t)


def _usable(prices: Sequence[float]) -> bool:
    return all(math.isfinite(price) and price > 0 for price in prices)


def _rsi(closes: Sequence[float], period: int) -> float:
    if len(closes) < period + 1 or not _usable(closes):
        return 0.0
    changes = [b - a for a, b in pairwise(closes)]
    gain = sum(max(change, 0.0) for change in changes[:period]) / period
    loss = sum(max(-change, 0.0) for change in changes[:period]) / period
    for change in changes[period:]:
        gain = (gain * (period - 1) + max(change, 0.0)) / period
        loss = (loss * (period - 1) + max(-change, 0.0)) / period
    if loss == 0:
        return 50.0 if gain == 0 else 100.0
    return 100.0 - 100.0 / (1.0 + gain / loss)


def _return(closes: Sequence[float], span: int) -> float:
    if len(closes) < span + 1 or not _usable((closes[-1], closes[-span - 1])):
        return 0.0
    return closes[-1] / closes[-span - 1] - 1.0


def _volatility(closes: Sequence[float]) -> float:
    if len(closes) < 3 or not _usable(closes):
        return 0.0
    # log(b) - log(a), not log(b / a): the ratio of extreme prices can underflow to 0.
    returns = [math.log(b) - math.log(a) for a, b in pairwise(closes)]
    mean = sum(returns) / len(returns)
    return math.sqrt(sum((r - mean) * (r - mean) for r in returns) / (len(returns) - 1))


def _zscore(volumes: Sequence[float]) -> float:
    if len(volumes) < 2 or not all(math.isfinite(volume) for volume in volumes):
        return 0.0
    mean = sum(volumes) / len(volumes)
    # d * d, not d ** 2: a float product overflows to inf (then 0.0 below), a power raises.
    std = math.sqrt(sum((volume - mean) * (volume - mean) for volume in volumes) / len(volumes))
    # A relative floor: float noise in identical volumes must not read as a huge z-score.
    if std <= 1e-12 * max(1.0, abs(mean)):
        return 0.0
    return (volumes[-1] - mean) / std


def _drawdown(window: Sequence[Candle]) -> float:
    if not window:
        return 0.0
    peak = max(max(candle.h, candle.c) for candle in window)
    last = window[-1].c
    if not _usable((peak, last)):
        return 0.0
    return max(0.0, 1.0 - last / peak)
