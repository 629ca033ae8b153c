"""The weekly digest's aggregation: one user's trades and tags of a period into the digest's JSON.

Pure: no I/O. The stage reads the rows, calls :func:`aggregate`, writes the snapshot to
``digests/{userId}/{periodStart}-{periodEnd}.json`` and upserts ``trading_digests``.

**The window.** ``[period_start 00:00 UTC, period_end 00:00 UTC)``, the end exclusive. ``trades``
are the user's trades in it; a trade outside it is a caller's bug (:class:`ValueError`). Rows are
mappings (a SQLAlchemy ``RowMapping`` will do) with ``id, symbol, side, qty, price, fee, ts``;
``ts`` an aware datetime (naive: UTC) or an ISO 8601 string; the numbers ``Decimal``, ``int``,
``float`` or a decimal string. Trades are taken in ``(ts, id)`` order whatever the input order,
the order the scorer uses.

**Realized P/L** is FIFO per symbol (:func:`~tasks.trading.heuristics.fifo_realized_pnl`). Only
the window's trades count, but a SELL in the window may close lots bought before it: those are
known only when passed in ``history`` (the user's earlier trades of the window's symbols, all
before the window, ids disjoint from ``trades``). Without them, the unmatched part of a SELL is
ignored (no short positions) and a SELL that matches nothing is not a closing trade. A *closing
trade* is a window trade with a realized P/L (a SELL that matched at least part of a lot).

**Counts and attribution.** ``by_label`` counts the window trades' tags per label (a trade with
two labels counts once under each). ``pnl_by_label``: a closing trade's whole realized P/L goes to
its *primary* label, the one of highest confidence (ties: the label first in alphabetical
order), never split: a trade is one decision, and splitting by confidence would invent fractions
of a bias. An untagged closing trade counts in ``realized_pnl`` only, so ``pnl_by_label`` sums to
``realized_pnl`` when every closing trade is tagged. Tags of trades outside ``trades`` are
ignored.

**Streaks** read the closing trades in time order, across symbols: a win has a realized P/L
above 0, a loss below 0 (after rounding to 8 decimals); a close at exactly 0 ends both runs.
``current`` is the run the last closing trade belongs to (``kind`` None, ``length`` 0 after a
0 close or with no close at all). ``active_days``: distinct UTC dates with a window trade.

**Top insight**: the window's tag of highest confidence; ties go to the earliest trade (by
``(ts, id)``), then the label first in alphabetical order. Its ``text`` is the tag's ``insight``
when the row has a non-empty one (the key is left out otherwise).

Output is deterministic and JSON-ready: maps sorted by label, floats rounded to 8 decimals
(``-0.0`` written ``0.0``). A period without trades gives zeros, empty maps and no top insight.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from tasks.trading.heuristics import fifo_realized_pnl

__all__ = ["aggregate", "snapshot_key"]

_PLACES = 8


@dataclass(frozen=True)
class _Trade:
    id: str
    symbol: str
    side: Literal["BUY", "SELL"]
    qty: Decimal
    price: Decimal
    fee: Decimal
    ts: datetime


@dataclass(frozen=True)
class _Tag:
    trade_id: str
    label: str
    confidence: float
    insight: str | None


def snapshot_key(user_id: str, period_start: date, period_end: date) -> str:
    """The storage key of a digest's JSON snapshot: ``digests/{userId}/{start}-{end}.json``."""
    return f"digests/{user_id}/{period_start.isoformat()}-{period_end.isoformat()}.json"


def aggregate(
    trades: Iterable[Mapping[str, Any]],
    tags: Iterable[Mapping[str, Any]],
    *,
    period_start: date,
    period_end: date,
    history: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The digest of one user's period (see the module docstring for every rule).

    Returns ``{"period": {"start", "end"}, "trades", "by_label", "pnl_by_label",
    "realized_pnl", "streaks": {"longest_win", "longest_loss", "current": {"kind", "length"}},
    "active_days", "top_insight": {"tradeId", "label", "confidence", "text"?} | None}``.

    Raises:
        ValueError: ``period_end <= period_start``, a trade outside the window, a ``history``
            trade not before it, a duplicate trade id, or a malformed row.
    """
    if period_end <= period_start:
        raise ValueError("a digest's period must end after it starts")
    opens = datetime.combine(period_start, time(), UTC)
    closes = datetime.combine(period_end, time(), UTC)
    window = sorted((_trade(row) for row in trades), key=_order)
    earlier = sorted((_trade(row) for row in history), key=_order)
    ids = {trade.id for trade in window}
    if (
        len(ids) != len(window)
        or len({t.id for t in earlier}) != len(earlier)
        or ids & {t.id for t in earlier}
    ):
        raise ValueError("trade ids must be unique across the window and its history")
    if any(not opens <= trade.ts < closes for trade in window):
        raise ValueError("a trade lies outside the digest's period")
    if any(trade.ts >= opens for trade in earlier):
        raise ValueError("a history trade is not before the digest's period")

    pnl = _realized(window, earlier)
    by_trade: dict[str, list[_Tag]] = defaultdict(list)
    for row in tags:
        tag = _tag(row)
        if tag.trade_id in ids:
            by_trade[tag.trade_id].append(tag)

    by_label = Counter(tag.label for found in by_trade.values() for tag in found)
    attributed: dict[str, list[float]] = defaultdict(list)
    for trade in window:
        found = by_trade.get(trade.id)
        if trade.id in pnl and found:
            primary = min(found, key=lambda tag: (-tag.confidence, tag.label))
            attributed[primary.label].append(pnl[trade.id])

    return {
        "period": {"start": period_start.isoformat(), "end": period_end.isoformat()},
        "trades": len(window),
        "by_label": {label: by_label[label] for label in sorted(by_label)},
        "pnl_by_label": {label: _round(math.fsum(attributed[label])) for label in sorted(attributed)},
        "realized_pnl": _round(math.fsum(pnl.values())),
        "streaks": _streaks([pnl[trade.id] for trade in window if trade.id in pnl]),
        "active_days": len({trade.ts.date() for trade in window}),
        "top_insight": _top_insight(window, by_trade),
    }


def _realized(window: list[_Trade], earlier: list[_Trade]) -> dict[str, float]:
    """Realized P/L of the window's closing trades, by trade id."""
    symbols: dict[str, list[_Trade]] = defaultdict(list)
    for trade in window:
        symbols[trade.symbol].append(trade)
    before: dict[str, list[_Trade]] = defaultdict(list)
    for trade in earlier:
        if trade.symbol in symbols:
            before[trade.symbol].append(trade)
    realized: dict[str, float] = {}
    for symbol, own in symbols.items():
        # History is entirely before the window, so concatenating keeps time order.
        sequence = before[symbol] + own
        results = fifo_realized_pnl([(t.side, t.qty, t.price, t.fee) for t in sequence])
        for trade, value in zip(sequence[len(before[symbol]) :], results[len(before[symbol]) :], strict=True):
            if value is not None:
                realized[trade.id] = value
    return realized


def _streaks(closes: list[float]) -> dict[str, Any]:
    longest = {"win": 0, "loss": 0}
    kind: str | None = None
    length = 0
    for value in closes:
        rounded = _round(value)
        now = "win" if rounded > 0 else "loss" if rounded < 0 else None
        length = length + 1 if now is not None and now == kind else (1 if now is not None else 0)
        kind = now
        if kind is not None:
            longest[kind] = max(longest[kind], length)
    return {
        "longest_win": longest["win"],
        "longest_loss": longest["loss"],
        "current": {"kind": kind, "length": length},
    }


def _top_insight(window: list[_Trade], by_trade: Mapping[str, list[_Tag]]) -> dict[str, Any] | None:
    position = {trade.id: i for i, trade in enumerate(window)}
    candidates = [tag for found in by_trade.values() for tag in found]
    if not candidates:
        return None
    best = min(candidates, key=lambda tag: (-tag.confidence, position[tag.trade_id], tag.label))
    top: dict[str, Any] = {
        "tradeId": best.trade_id,
        "label": best.label,
        "confidence": _round(best.confidence),
    }
    if best.insight:
        top["text"] = best.insight
    return top


def _order(trade: _Trade) -> tuple[datetime, str]:
    return trade.ts, trade.id


def _trade(row: Mapping[str, Any]) -> _Trade:
    try:
        side = str(row["side"]).upper()
        if side not in ("BUY", "SELL"):
            raise ValueError("a trade's side must be BUY or SELL")
        return _Trade(
            id=str(row["id"]),
            symbol=str(row["symbol"]),
            side="BUY" if side == "BUY" else "SELL",
            qty=_number(row["qty"]),
            price=_number(row["price"]),
            fee=_number(row["fee"]),
            ts=_timestamp(row["ts"]),
        )
    except KeyError as exc:
        raise ValueError(f"a trade row lacks {exc.args[0]!r}") from None


def _tag(row: Mapping[str, Any]) -> _Tag:
    try:
        confidence = row["confidence"]
        if isinstance(confidence, bool) or not isinstance(confidence, int | float | Decimal):
            raise ValueError("a tag's confidence must be a number")
        if not math.isfinite(float(confidence)):
            raise ValueError("a tag's confidence must be finite")
        insight = row.get("insight")
        return _Tag(
            trade_id=str(row["trade_id"]),
            label=str(row["label"]),
            confidence=float(confidence),
            insight=str(insight) if insight else None,
        )
    except KeyError as exc:
        raise ValueError(f"a tag row lacks {exc.args[0]!r}") from None


def _number(value: object) -> Decimal:
    if isinstance(value, bool):
        raise ValueError("a quantity, price or fee must be a number")
    if isinstance(value, Decimal | int):
        return Decimal(value)
    if isinstance(value, float):
        # repr(): the shortest form, so 0.1 stays the broker's "0.1" (as the heuristics read it).
        return Decimal(repr(value))
    if isinstance(value, str):
        try:
            return Decimal(value.strip())
        except InvalidOperation:
            raise ValueError("a quantity, price or fee must be a decimal number") from None
    raise ValueError("a quantity, price or fee must be a number")


def _timestamp(value: object) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError("a trade's ts must be an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise ValueError("a trade's ts must be a datetime")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _round(value: float) -> float:
    # + 0.0 turns -0.0 into 0.0, which JSON would otherwise write as "-0.0".
    return round(float(value), _PLACES) + 0.0
