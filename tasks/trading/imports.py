"""``import.trades``, page by page: fetch, normalize, upsert, progress, resume.

Each page commits in one fenced transaction: its trades (insert-or-ignore by
``(user_id, broker, ext_id)``), its rejects, the import's cursor and counters, and an
``import.progress`` event. A crash, preemption or deferral between pages resumes from the
last committed cursor, so no committed page is fetched again, and a page served twice
stores its trades once.

A broker's rate limit never costs an attempt: a 429 (its ``Retry-After``), or a window
that ran out (``X-RateLimit-Remaining: 0`` until its reset), waits that long plus the
safety margin; a wait up to :data:`MAX_SLEEP` is slept in the body, a longer one (and
every 429) parks the job with :class:`conveyor.errors.Deferred`.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select

from conveyor import tracing
from conveyor.context import JobContext
from conveyor.errors import Deferred, PayloadInvalid
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.jobs import new_event
from tasks.trading import tables as t
from tasks.trading import telemetry
from tasks.trading.broker import BrokerClient, Page
from tasks.trading.errors import BrokerUnauthorized, RateLimited
from tasks.trading.normalize import Rejected, Trade, normalize

MAX_SLEEP = 2.0
_TRADE_IDS = uuid.UUID("3f0d7a52-6c8e-4b7e-9d4c-8a1e2b5f6c70")

Emit = Callable[[Connection, str, dict[str, Any]], None]


def trade_id(user_id: str, broker: str, ext_id: str) -> str:
    """The stored trade's id (``tradeId``): the same for the same broker trade, always."""
    return str(uuid.uuid5(_TRADE_IDS, f"{user_id}\n{broker}\n{ext_id}"))


def default_since(today: dt.date) -> dt.date:
    """The seed's default window: 30 days before today (UTC)."""
    return today - dt.timedelta(days=30)


@dataclass
class Progress:
    """One import job's committed cursor and counters."""

    cursor: str | None = None
    pages: int = 0
    fetched: int = 0
    stored: int = 0
    rejected: int = 0
    done: bool = False

    def result(self) -> dict[str, int]:
        """The counters, as the job's result has them."""
        return {
            "fetched": self.fetched,
            "stored": self.stored,
            "rejected": self.rejected,
            "pages": self.pages,
        }


def resume_point(conn: Connection, job_id: str) -> Progress:
    """What an earlier attempt of this job committed (nothing: from the start)."""
    row = conn.execute(select(t.imports).where(t.imports.c.job_id == job_id)).mappings().first()
    if row is None:
        return Progress()
    return Progress(
        cursor=row["cursor"],
        pages=int(row["pages"]),
        fetched=int(row["fetched"]),
        stored=int(row["stored"]),
        rejected=int(row["rejected"]),
        done=bool(row["done"]),
    )


def day_of(value: str) -> dt.date:
    """A payload's ``YYYY-MM-DD`` as a day; one the calendar lacks is the caller's mistake."""
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise PayloadInvalid(f"sinceIso: {value} is not a day of the calendar") from None


def check_since(since: dt.date, today: dt.date) -> None:
    """A window that starts in the future is a caller's mistake: dead-letter it at once."""
    if since > today:
        raise PayloadInvalid(
            f"sinceIso: {since.isoformat()} is in the future (today is {today.isoformat()} UTC); "
            "give a past day or leave it out for the last 30 days"
        )


class Importer:
    """Pulls one user's trades from one broker into ``trading_trades``."""

    def __init__(
        self,
        ctx: JobContext,
        client: BrokerClient,
        *,
        user_id: str,
        broker: str,
        token: str,
        since: dt.date,
        safety_s: float,
        emit: Emit,
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.user_id = user_id
        self.broker = broker
        self._token = token
        self.since = since
        self.safety_s = safety_s
        self.emit = emit
        self.log = ctx.log.bind(userId=user_id, broker=broker)

    def run(self, progress: Progress) -> Progress:
        """Fetch and commit pages from ``progress`` on until the broker has no next page."""
        while not progress.done:
            self.ctx.checkpoint()
            page = self._fetch(progress)
            progress = self._commit(page, progress)
            if not progress.done:
                self._respect(page)
        return progress

    def _fetch(self, progress: Progress) -> Page:
        number = progress.pages + 1
        try:
            with tracing.span("trading.fetch", attributes={"trading.page": number}):
                return self.client.fetch_page(
                    self.broker, self._token, self.since, progress.cursor, number=number
                )
        except RateLimited as limited:
            telemetry.saw_429("broker")
            wait = limited.retry_after + self.safety_s
            self.log.warning("broker rate limited (429); resets in %.3fs", limited.retry_after)
            raise Deferred(
                wait, f"{self.broker} answered 429 for page {number}: retry after {wait:.3f}s"
            ) from None
        except BrokerUnauthorized:
            raise BrokerUnauthorized(
                f"{self.broker} refused the stored token of user {self.user_id} (HTTP 401): "
                f"connect again (conveyor trading connect --user {self.user_id} --broker {self.broker})"
            ) from None

    def _respect(self, page: Page) -> None:
        """The window ran out: wait for its reset (slept if short, else deferred)."""
        if page.remaining is None or page.remaining > 0 or not page.reset_s:
            return
        wait = page.reset_s + self.safety_s
        self.log.info("broker rate limit window spent; resets in %.3fs", page.reset_s)
        if wait > MAX_SLEEP:
            raise Deferred(wait, f"{self.broker} rate limit window spent after page {page.number}")
        time.sleep(wait)

    def _commit(self, page: Page, progress: Progress) -> Progress:
        good: dict[str, Trade] = {}
        bad: list[Rejected] = []
        with tracing.span("trading.normalize", attributes={"trading.rows": len(page.rows)}):
            for row in page.rows:
                found = normalize(self.broker, row)  # type: ignore[arg-type]
                if isinstance(found, Rejected):
                    bad.append(found)
                else:
                    good.setdefault(found.ext_id, found)  # a row repeated within the page: once
        repeated = len(page.rows) - len(bad) - len(good)
        with (
            tracing.span("trading.upsert", attributes={"trading.page": page.number}),
            self.ctx.fenced() as conn,
        ):
            stored = self._upsert(conn, list(good.values()))
            if bad:
                conn.execute(
                    insert(t.rejects).values(created_at=db_now()),
                    [
                        {
                            "job_id": self.ctx.job_id,
                            "user_id": self.user_id,
                            "broker": self.broker,
                            "page": page.number,
                            "ext_id": r.ext_id,
                            "reason": r.reason[:200],
                        }
                        for r in bad
                    ],
                )
            after = Progress(
                cursor=page.next,
                pages=page.number,
                fetched=progress.fetched + len(page.rows),
                stored=progress.stored + stored,
                rejected=progress.rejected + len(bad),
                done=page.next is None,
            )
            self._save(conn, after)
            percent = 100.0 if after.done else (page.percent if page.percent is not None else None)
            body = {"jobId": self.ctx.job_id, "userId": self.user_id, "percent": percent, **after.result()}
            body.pop("pages")
            with tracing.span("trading.outbox"):
                self.emit(conn, "import.progress", body)
        telemetry.committed("import.progress")
        if repeated:
            self.log.info("page %s repeated %s rows; stored once", page.number, repeated)
        return after

    def _upsert(self, conn: Connection, found: list[Trade]) -> int:
        if not found:
            return 0
        rows = [
            {
                "id": trade_id(self.user_id, self.broker, tr.ext_id),
                "user_id": self.user_id,
                "broker": self.broker,
                "ext_id": tr.ext_id,
                "symbol": tr.symbol,
                "side": tr.side,
                "qty": tr.qty,
                "price": tr.price,
                "fee": tr.fee,
                "ts": tr.ts,
                "import_job": self.ctx.job_id,
            }
            for tr in found
        ]
        stmt = (
            upsert(conn, t.trades)
            .values(created_at=db_now())
            .on_conflict_do_nothing(index_elements=["user_id", "broker", "ext_id"])
        )
        # RETURNING names only the rows inserted: a trade stored before is not counted.
        return len(conn.execute(stmt.returning(t.trades.c.id), rows).all())

    def _save(self, conn: Connection, p: Progress) -> None:
        values = {
            "cursor": p.cursor,
            "pages": p.pages,
            "fetched": p.fetched,
            "stored": p.stored,
            "rejected": p.rejected,
            "done": int(p.done),
            "updated_at": db_now(),
        }
        stmt = upsert(conn, t.imports).values(
            job_id=self.ctx.job_id,
            user_id=self.user_id,
            broker=self.broker,
            since=self.since.isoformat(),
            **values,
        )
        conn.execute(stmt.on_conflict_do_update(index_elements=["job_id"], set_=values))


def db_emit(store: Any, job_id: str) -> Emit:
    """An emitter that writes a job's event on the given connection (a fenced batch's)."""

    def emit(conn: Connection, topic: str, body: dict[str, Any]) -> None:
        store.emit(conn, [new_event(job_id, topic, body)])

    return emit


__all__ = [
    "MAX_SLEEP",
    "Importer",
    "Progress",
    "check_since",
    "day_of",
    "db_emit",
    "default_since",
    "resume_point",
    "trade_id",
]
