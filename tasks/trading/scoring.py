"""``score.bias``, batch by batch: OHLCV preloaded per symbol, the coach's ``/v1/bias``
once per batch, then per trade ``/v1/indicators``, the v1 heuristics and
``/v1/nlg/reflect``; each batch commits its tags, one ``coach.reflect`` per trade and the
score's cursor in one fenced transaction.

A trade's tags replace its earlier ones (unique by ``(trade_id, label)``). The cursor is
the last trade committed, so a preempted, cancelled or killed score resumes after it and
never emits a second ``coach.reflect`` for a trade; an uncommitted batch is redone whole.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, select

from conveyor.context import JobContext
from conveyor.errors import Deferred
from conveyor.store.db.dialect import db_now, upsert
from tasks.trading import tables as t
from tasks.trading import telemetry
from tasks.trading.coach import CoachClient
from tasks.trading.errors import RateLimited
from tasks.trading.heuristics import BiasTag, TradeFacts, fifo_realized_pnl, tag
from tasks.trading.imports import Emit
from tasks.trading.market import MarketClient
from tasks.trading.series import Candle, spark, window_before

TONE = "supportive"
WINDOW_HOURS = 48  # the OHLCV before a trade the indicators read


@dataclass
class Cursor:
    """One score job's committed position and counts."""

    last_ts: dt.datetime | None = None
    last_id: str | None = None
    batches: int = 0
    tagged: int = 0
    reflected: int = 0

    def result(self) -> dict[str, int]:
        """The counts, as the job's result has them."""
        return {"batches": self.batches, "tagged": self.tagged, "reflected": self.reflected}


def resume_cursor(conn: Connection, job_id: str) -> Cursor:
    """What an earlier attempt of this score committed (nothing: from the first trade)."""
    row = conn.execute(select(t.scores).where(t.scores.c.job_id == job_id)).mappings().first()
    if row is None:
        return Cursor()
    return Cursor(
        row["last_ts"], row["last_id"], int(row["batches"]), int(row["tagged"]), int(row["reflected"])
    )


def load_facts(
    conn: Connection, user_id: str, since: dt.date, *, untagged_only: bool = False
) -> list[TradeFacts]:
    """The user's trades since ``since`` in (time, id) order, each with what the
    heuristics read of the day before it (its history starts a day earlier); with
    ``untagged_only``, only those no score has tagged yet."""
    start = dt.datetime.combine(since, dt.time(), tzinfo=dt.UTC)
    rows = (
        conn.execute(
            select(t.trades)
            .where(t.trades.c.user_id == user_id, t.trades.c.ts >= start - dt.timedelta(days=1))
            .order_by(t.trades.c.ts, t.trades.c.id)
        )
        .mappings()
        .all()
    )
    by_symbol: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_symbol[r["symbol"]].append(i)
    realized: list[float | None] = [None] * len(rows)
    for indexes in by_symbol.values():
        lots = [
            (rows[i]["side"], float(rows[i]["qty"]), float(rows[i]["price"]), float(rows[i]["fee"]))
            for i in indexes
        ]
        for i, pnl in zip(indexes, fifo_realized_pnl(lots), strict=True):
            realized[i] = pnl
    facts: list[TradeFacts] = []
    last_close: float | None = None
    last_close_at: dt.datetime | None = None
    for i, r in enumerate(rows):
        ts = r["ts"]
        earlier = [rows[j]["ts"] for j in range(max(0, i - 500), i)]
        if ts >= start:
            facts.append(
                TradeFacts(
                    trade_id=r["id"],
                    symbol=r["symbol"],
                    side=r["side"],
                    qty=float(r["qty"]),
                    price=float(r["price"]),
                    ts=ts,
                    trades_prev_24h=sum(1 for e in earlier if ts - e <= dt.timedelta(hours=24)),
                    minutes_since_prev=(ts - earlier[-1]).total_seconds() / 60 if earlier else None,
                    prev_realized_pnl=last_close,
                    minutes_since_prev_close=(
                        (ts - last_close_at).total_seconds() / 60 if last_close_at is not None else None
                    ),
                )
            )
        if realized[i] is not None:
            last_close, last_close_at = realized[i], ts
    if untagged_only and facts:
        tagged = set(
            conn.execute(select(t.tags.c.trade_id).where(t.tags.c.user_id == user_id).distinct()).scalars()
        )
        facts = [f for f in facts if f.trade_id not in tagged]
    return facts


def after(facts: list[TradeFacts], cursor: Cursor) -> list[TradeFacts]:
    """The trades past the committed cursor."""
    if cursor.last_ts is None or cursor.last_id is None:
        return facts
    mark = (cursor.last_ts, cursor.last_id)
    return [f for f in facts if (f.ts, f.trade_id) > mark]


class Scorer:
    """Tags one user's trades and tells the coach's reflections, batch by batch."""

    def __init__(
        self,
        ctx: JobContext,
        coach: CoachClient,
        market: MarketClient,
        *,
        user_id: str,
        since: dt.date,
        batch: int,
        emit: Emit,
    ) -> None:
        self.ctx = ctx
        self.coach = coach
        self.market = market
        self.user_id = user_id
        self.since = since
        self.batch = batch
        self.emit = emit
        self.log = ctx.log.bind(userId=user_id)

    def run(self, facts: list[TradeFacts], cursor: Cursor) -> Cursor:
        """Score every trade past ``cursor``, committing batch by batch."""
        todo = after(facts, cursor)
        for start in range(0, len(todo), self.batch):
            self.ctx.checkpoint()
            cursor = self._batch(todo[start : start + self.batch], cursor)
        return cursor

    def _batch(self, batch: list[TradeFacts], cursor: Cursor) -> Cursor:
        series = self._preload(batch)
        scores = self.coach.bias(
            self.user_id,
            [
                {
                    "tradeId": f.trade_id,
                    "symbol": f.symbol,
                    "side": f.side,
                    "qty": f.qty,
                    "price": f.price,
                    "ts": _iso(f.ts),
                }
                for f in batch
            ],
        )
        told: list[tuple[TradeFacts, list[BiasTag], str, list[float]]] = []
        for f in batch:
            self.ctx.checkpoint()
            candles = series.get(f.symbol, [])
            indicators = self.coach.indicators(f.symbol, f.ts, window_before(candles, f.ts, WINDOW_HOURS))
            found = tag(f, indicators, scores.get(f.trade_id, {}))
            insight = self.coach.reflect(found[0].features, found[0].label, TONE)
            told.append((f, found, insight, spark(candles, f.ts)))
        with self.ctx.fenced() as conn:
            for f, found, insight, sparkline in told:
                self._replace_tags(conn, f.trade_id, found, insight)
                self.emit(
                    conn,
                    "coach.reflect",
                    {
                        "userId": self.user_id,
                        "tradeId": f.trade_id,
                        "labels": [{"name": b.label, "confidence": b.confidence} for b in found],
                        "insight": insight,
                        "sparklines": sparkline,
                        "tone": TONE,
                    },
                )
            last = batch[-1]
            cursor = Cursor(
                last.ts,
                last.trade_id,
                cursor.batches + 1,
                cursor.tagged + sum(len(found) for _, found, _, _ in told),
                cursor.reflected + len(told),
            )
            self._save(conn, cursor)
        telemetry.committed("coach.reflect", len(told))
        return cursor

    def _preload(self, batch: list[TradeFacts]) -> dict[str, list[Candle]]:
        symbols = sorted({f.symbol for f in batch})
        start = min(f.ts for f in batch) - dt.timedelta(hours=WINDOW_HOURS + 1)
        end = max(f.ts for f in batch) + dt.timedelta(hours=1)
        try:
            return self.market.preload(symbols, "1h", start, end)
        except RateLimited as limited:
            raise Deferred(
                limited.retry_after, f"market data rate limited ({limited.retry_after:.3f}s)"
            ) from None

    def _replace_tags(self, conn: Connection, trade_id: str, found: list[BiasTag], insight: str) -> None:
        labels = [b.label for b in found]
        conn.execute(delete(t.tags).where(t.tags.c.trade_id == trade_id, t.tags.c.label.not_in(labels)))
        for b in found:
            values: dict[str, Any] = {
                "confidence": b.confidence,
                "features": dict(b.features),
                "insight": insight,
                "score_job": self.ctx.job_id,
                "created_at": db_now(),
            }
            stmt = upsert(conn, t.tags).values(
                trade_id=trade_id, user_id=self.user_id, label=b.label, **values
            )
            conn.execute(stmt.on_conflict_do_update(index_elements=["trade_id", "label"], set_=values))

    def _save(self, conn: Connection, c: Cursor) -> None:
        values = {
            "last_ts": c.last_ts,
            "last_id": c.last_id,
            "batches": c.batches,
            "tagged": c.tagged,
            "reflected": c.reflected,
            "updated_at": db_now(),
        }
        stmt = upsert(conn, t.scores).values(
            job_id=self.ctx.job_id, user_id=self.user_id, since=self.since.isoformat(), **values
        )
        conn.execute(stmt.on_conflict_do_update(index_elements=["job_id"], set_=values))


def _iso(ts: dt.datetime) -> str:
    return ts.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


__all__ = ["Cursor", "Scorer", "after", "load_facts", "resume_cursor"]
