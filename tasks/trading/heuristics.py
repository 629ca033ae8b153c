"""Static v1 bias heuristics (the seed's "apply thresholds/patterns"), and FIFO realized P/L.

Pure: no I/O. :func:`tag` reads one trade's facts, the market indicators before it (the keys of
:func:`tasks.trading.series.local_indicators`, as ``/v1/indicators`` returns them) and the AI
coach's ``/v1/bias`` scores for it, and returns at least one :class:`BiasTag`.

Labels and their v1 thresholds (:data:`THRESHOLDS`):

===================  ============================================================================
``fomo``             a BUY after a run-up: ``return_24h >= +5 %`` or ``rsi_14 >= 70``
``panic_sell``       a SELL after a drop: ``return_24h <= -5 %`` or ``rsi_14 <= 30``
``revenge_trading``  any trade within 30 minutes after a losing close (``prev_realized_pnl < 0``;
                     the minutes are ``minutes_since_prev_close`` when the caller knows them, else
                     ``minutes_since_prev``)
``overtrading``      the 10th or later trade of the user within 24 h
                     (``trades_prev_24h + 1 >= 10``)
``neutral``          when none of the above fires
===================  ============================================================================

An indicator only counts when the window had enough candles for it (``candles`` >= 15 for the RSI,
>= 25 for the 24 h return; without a ``candles`` key, a 0.0 -- the "no data" value -- does not
count).

**Confidence.** Each rule compares a value ``x`` with its threshold ``θ`` from a neutral baseline
``b`` (returns 0, RSI 50, minutes ``2θ``, trades 1): ``r = (x - b) / (θ - b)``, so ``r >= 1`` fires.
A fired label's heuristic strength is ``s = 0.5 + 0.5 * min(1, r - 1)`` (0.5 just at the threshold,
1.0 once as far past it again), the best of its rules. With the AI's score ``a`` for that label,
``confidence = 0.7 * s + 0.3 * a``; with no score, ``confidence = s``. ``neutral``: with ``p`` the
closest any rule came (``max r``, below 1), ``s = 1 - 0.5 * p``, and with ``a`` the AI's highest
score over the labels, ``confidence = 0.7 * s + 0.3 * (1 - a)`` (``s`` alone with no score).
Confidences are rounded to 3 decimals; tags are ordered by confidence, highest first, then label.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal, TypeGuard

__all__ = [
    "BIAS_LABELS",
    "LABELS",
    "THRESHOLDS",
    "BiasTag",
    "Thresholds",
    "TradeFacts",
    "fifo_realized_pnl",
    "tag",
]

Side = Literal["BUY", "SELL"]
Number = Decimal | float | int
Feature = float | int | str

BIAS_LABELS = ("fomo", "panic_sell", "revenge_trading", "overtrading")
LABELS = (*BIAS_LABELS, "neutral")


@dataclass(frozen=True)
class Thresholds:
    """The static v1 numbers (see the module docstring)."""

    fomo_return_24h: float = 0.05
    fomo_rsi_14: float = 70.0
    panic_return_24h: float = -0.05
    panic_rsi_14: float = 30.0
    revenge_minutes: float = 30.0
    overtrading_trades_24h: int = 10
    rsi_min_candles: int = 15
    return_min_candles: int = 25
    ai_weight: float = 0.3


THRESHOLDS = Thresholds()

_RSI_BASELINE = 50.0
_TRADES_BASELINE = 1.0


@dataclass(frozen=True)
class BiasTag:
    """One label on one trade: how sure, and what fired (small, JSON-ready)."""

    label: str
    confidence: float
    features: dict[str, Feature]


@dataclass(frozen=True)
class TradeFacts:
    """What the score stage knows of one trade and of its user's recent history."""

    trade_id: str
    symbol: str
    side: Side
    qty: float
    price: float
    ts: datetime
    trades_prev_24h: int  # the user's trades in the 24 h before this one
    minutes_since_prev: float | None
    prev_realized_pnl: float | None  # realized P/L of the user's previous closing trade, if any
    # Minutes since that previous closing trade, when the caller knows it; revenge then uses it.
    minutes_since_prev_close: float | None = None


@dataclass(frozen=True)
class _Rule:
    ratio: float  # r = (x - b) / (θ - b); fires at r >= 1
    feature: str
    value: float


def tag(
    facts: TradeFacts,
    indicators: Mapping[str, float],
    bias_scores: Mapping[str, float],
    *,
    thresholds: Thresholds = THRESHOLDS,
) -> list[BiasTag]:
    """The bias tags of one trade: at least one, unique labels, by confidence desc then label."""
    rules = _rules(facts, indicators, thresholds)
    scores = _scores(bias_scores)
    weight = thresholds.ai_weight
    tags: list[BiasTag] = []
    for label in BIAS_LABELS:
        fired = [rule for rule in rules.get(label, []) if rule.ratio >= 1.0]
        if not fired:
            continue
        strength = max(0.5 + 0.5 * min(1.0, rule.ratio - 1.0) for rule in fired)
        features: dict[str, Feature] = {rule.feature: _round(rule.value) for rule in fired}
        features.update(_context(label, facts))
        score = scores.get(label)
        if score is None:
            confidence = strength
        else:
            confidence = (1.0 - weight) * strength + weight * score
            features["ai_score"] = round(score, 3)
        tags.append(BiasTag(label, _confidence(confidence), features))
    if not tags:
        tags.append(_neutral(facts, indicators, rules, scores, thresholds))
    tags.sort(key=lambda item: (-item.confidence, item.label))
    return tags


def fifo_realized_pnl(trades: Sequence[tuple[Side, Number, Number, Number]]) -> list[float | None]:
    """Realized P/L per trade under FIFO lot matching, for one symbol's trades in time order.

    Each trade is ``(side, qty, price, fee)``. A BUY opens a lot costing ``qty * price + fee`` and
    gets None. A SELL closes the oldest lots first: its P/L is, over the matched quantity, the
    proceeds minus the matched lots' cost (their fee included pro rata) minus the SELL's fee pro
    rata to the matched part. A SELL beyond the holdings ignores the unmatched part (no short
    positions); a SELL matching nothing gets None. Raises ``ValueError`` on an unknown side, a
    quantity <= 0 or a negative price or fee.
    """
    lots: deque[list[Decimal]] = deque()  # [remaining qty, cost per unit including the buy fee]
    result: list[float | None] = []
    for side, raw_qty, raw_price, raw_fee in trades:
        qty, price, fee = _dec(raw_qty), _dec(raw_price), _dec(raw_fee)
        if qty <= 0 or price < 0 or fee < 0:
            raise ValueError("a trade needs qty > 0, price >= 0 and fee >= 0")
        if side == "BUY":
            lots.append([qty, (qty * price + fee) / qty])
            result.append(None)
            continue
        if side != "SELL":
            raise ValueError("side must be BUY or SELL")
        left, matched, cost = qty, Decimal(0), Decimal(0)
        while left > 0 and lots:
            lot = lots[0]
            take = min(left, lot[0])
            matched += take
            cost += take * lot[1]
            left -= take
            lot[0] -= take
            if lot[0] <= 0:
                lots.popleft()
        if matched == 0:
            result.append(None)
            continue
        result.append(float(matched * price - cost - fee * matched / qty))
    return result


def _rules(facts: TradeFacts, indicators: Mapping[str, float], th: Thresholds) -> dict[str, list[_Rule]]:
    rsi = _indicator(indicators, "rsi_14", th.rsi_min_candles)
    ret = _indicator(indicators, "return_24h", th.return_min_candles)
    rules: dict[str, list[_Rule]] = {label: [] for label in BIAS_LABELS}
    if facts.side == "BUY":
        if ret is not None:
            rules["fomo"].append(_Rule(ret / th.fomo_return_24h, "return_24h", ret))
        if rsi is not None:
            ratio = (rsi - _RSI_BASELINE) / (th.fomo_rsi_14 - _RSI_BASELINE)
            rules["fomo"].append(_Rule(ratio, "rsi_14", rsi))
    else:
        if ret is not None:
            rules["panic_sell"].append(_Rule(ret / th.panic_return_24h, "return_24h", ret))
        if rsi is not None:
            ratio = (rsi - _RSI_BASELINE) / (th.panic_rsi_14 - _RSI_BASELINE)
            rules["panic_sell"].append(_Rule(ratio, "rsi_14", rsi))
    minutes = facts.minutes_since_prev_close
    if minutes is None:
        minutes = facts.minutes_since_prev
    pnl = facts.prev_realized_pnl
    if _finite(minutes) and _finite(pnl) and pnl < 0 and minutes >= 0:
        # Baseline 2θ: r = (2θ - m) / θ, 1 at the threshold, 2 for a trade in the same minute.
        ratio = (2 * th.revenge_minutes - minutes) / th.revenge_minutes
        rules["revenge_trading"].append(_Rule(ratio, "minutes_since_loss", minutes))
    trades_24h = max(0, facts.trades_prev_24h) + 1
    ratio = (trades_24h - _TRADES_BASELINE) / (th.overtrading_trades_24h - _TRADES_BASELINE)
    rules["overtrading"].append(_Rule(ratio, "trades_24h", trades_24h))
    return rules


def _context(label: str, facts: TradeFacts) -> dict[str, Feature]:
    """The non-indicator facts a fired label rests on."""
    if label == "revenge_trading" and facts.prev_realized_pnl is not None:
        return {"prev_realized_pnl": _round(facts.prev_realized_pnl)}
    if label in ("fomo", "panic_sell"):
        return {"side": facts.side}
    return {}


def _neutral(
    facts: TradeFacts,
    indicators: Mapping[str, float],
    rules: Mapping[str, list[_Rule]],
    scores: Mapping[str, float],
    th: Thresholds,
) -> BiasTag:
    closest = max((max(0.0, rule.ratio) for group in rules.values() for rule in group), default=0.0)
    strength = 1.0 - 0.5 * min(1.0, closest)
    features: dict[str, Feature] = {"trades_24h": max(0, facts.trades_prev_24h) + 1}
    for key, min_candles in (("return_24h", th.return_min_candles), ("rsi_14", th.rsi_min_candles)):
        value = _indicator(indicators, key, min_candles)
        if value is not None:
            features[key] = _round(value)
    if not scores:
        return BiasTag("neutral", _confidence(strength), features)
    top = max(scores.values())
    features["ai_max_score"] = round(top, 3)
    return BiasTag(
        "neutral", _confidence((1.0 - th.ai_weight) * strength + th.ai_weight * (1.0 - top)), features
    )


def _indicator(indicators: Mapping[str, float], key: str, min_candles: int) -> float | None:
    """A usable indicator value, or None when missing, not a number or from too short a window."""
    value = indicators.get(key)
    if not _finite(value):
        return None
    candles = indicators.get("candles")
    if _finite(candles):
        return float(value) if candles >= min_candles else None
    # Without a candle count, 0.0 is the "missing data" value of /v1/indicators.
    return float(value) if value != 0 else None


def _scores(bias_scores: Mapping[str, float]) -> dict[str, float]:
    """The AI's scores for our labels, clamped to 0..1; anything else ignored."""
    return {
        label: min(1.0, max(0.0, float(score)))
        for label, score in bias_scores.items()
        if label in BIAS_LABELS and _finite(score)
    }


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _dec(value: Number) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float):
        raise ValueError("a quantity, price or fee must be a number")
    # repr(): a float's shortest exact-looking form, so 0.1 matches the broker's "0.1".
    number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not number.is_finite():
        raise ValueError("a quantity, price or fee must be finite")
    return number


def _round(value: float) -> float:
    return round(float(value), 6)


def _confidence(value: float) -> float:
    return round(min(1.0, max(0.0, value)), 3)
