"""``digest.weekly``: aggregate a user's period (:func:`tasks.trading.digest.aggregate`),
write its JSON snapshot, upsert ``trading_digests`` and emit ``digest.ready``; and the
weekly fan-out that submits one digest per user.

The snapshot is written first (``digests/{userId}/{periodStart}-{periodEnd}.json``, an S3
bucket or a local directory); the row and ``digest.ready {digestId, userId, period}`` commit
with the job's completion. So a digest row never exists without its snapshot: storage
unreachable is a transient failure before anything is recorded, and a retry writes the same
snapshot again (same key, same content).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, select, union

from conveyor.errors import PayloadInvalid
from conveyor.store.db.dialect import db_now, upsert
from tasks.trading import tables as t
from tasks.trading.digest import aggregate, snapshot_key

MAX_DAYS = 31
_DIGEST_IDS = uuid.UUID("0b6f1f0e-2f0a-4f57-8d1c-5b0e3c9d7a21")


def check_period(start: dt.date, end: dt.date, today: dt.date) -> None:
    """A period must end after it starts (end exclusive), span at most 31 days and be over
    (``end`` at most today, UTC): a digest of a running period would stand for the whole
    of it (one digest per period)."""
    if end <= start:
        raise PayloadInvalid(
            f"periodEnd: {end.isoformat()} must be after periodStart {start.isoformat()} "
            "(the end is exclusive)"
        )
    if (end - start).days > MAX_DAYS:
        raise PayloadInvalid(f"periodEnd: the period spans {(end - start).days} days, more than {MAX_DAYS}")
    if end > today:
        raise PayloadInvalid(
            f"periodEnd: {end.isoformat()} is after today ({today.isoformat()} UTC): a digest is made "
            "once its period is over"
        )


def digest_id(user_id: str, start: dt.date, end: dt.date) -> str:
    """The digest's id (``digestId``): the same for the same user and period, always."""
    return str(uuid.uuid5(_DIGEST_IDS, f"{user_id}\n{start.isoformat()}\n{end.isoformat()}"))


def _at(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)


def summarize(conn: Connection, user_id: str, start: dt.date, end: dt.date) -> dict[str, Any]:
    """The period's aggregate, from the user's trades and tags (and the earlier trades of
    the period's symbols, whose lots the period's sells may close)."""
    window: Any = (
        conn.execute(
            select(t.trades)
            .where(t.trades.c.user_id == user_id, t.trades.c.ts >= _at(start), t.trades.c.ts < _at(end))
            .order_by(t.trades.c.ts, t.trades.c.id)
        )
        .mappings()
        .all()
    )
    symbols = sorted({r["symbol"] for r in window})
    history: Any = (
        conn.execute(
            select(t.trades).where(
                t.trades.c.user_id == user_id, t.trades.c.ts < _at(start), t.trades.c.symbol.in_(symbols)
            )
        )
        .mappings()
        .all()
        if symbols
        else []
    )
    ids = [r["id"] for r in window]
    tags: list[Any] = []
    for i in range(0, len(ids), 500):
        tags += conn.execute(select(t.tags).where(t.tags.c.trade_id.in_(ids[i : i + 500]))).mappings().all()
    return aggregate(window, tags, period_start=start, period_end=end, history=history)


def snapshot(user_id: str, start: dt.date, end: dt.date, body: Mapping[str, Any]) -> tuple[str, bytes]:
    """The snapshot's key and bytes (the digest as JSON, with its id and user)."""
    doc = {"digestId": digest_id(user_id, start, end), "userId": user_id, **body}
    return snapshot_key(user_id, start, end), json.dumps(doc, sort_keys=True).encode()


def record(
    conn: Connection,
    job_id: str,
    user_id: str,
    start: dt.date,
    end: dt.date,
    ref: str,
    body: Mapping[str, Any],
) -> str:
    """Upsert the digest row by ``(user_id, period_start, period_end)``; its id."""
    found = digest_id(user_id, start, end)
    values = {"snapshot": ref, "body": dict(body), "job_id": job_id, "updated_at": db_now()}
    stmt = upsert(conn, t.digests).values(
        id=found,
        user_id=user_id,
        period_start=start.isoformat(),
        period_end=end.isoformat(),
        created_at=db_now(),
        **values,
    )
    conn.execute(
        stmt.on_conflict_do_update(index_elements=["user_id", "period_start", "period_end"], set_=values)
    )
    return found


def week_of(day: dt.date | None, today: dt.date) -> tuple[dt.date, dt.date]:
    """The ISO week (Monday to the next Monday) holding ``day``; None: the last full week."""
    anchor = day if day is not None else today - dt.timedelta(days=7)
    monday = anchor - dt.timedelta(days=anchor.weekday())
    return monday, monday + dt.timedelta(days=7)


def users_of_week(conn: Connection, start: dt.date, end: dt.date) -> list[str]:
    """Users with a trade in the week or a broker connection."""
    traded = select(t.trades.c.user_id).where(t.trades.c.ts >= _at(start), t.trades.c.ts < _at(end))
    connected = select(t.connections.c.user_id)
    return sorted({str(u) for u in conn.execute(union(traded, connected)).scalars()})


__all__ = [
    "MAX_DAYS",
    "check_period",
    "digest_id",
    "record",
    "snapshot",
    "summarize",
    "users_of_week",
    "week_of",
]
