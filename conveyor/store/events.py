"""Positions in the event outbox, in commit order, for readers paging with a cursor.

Writers insert events with no position. On Postgres a *sequencer* numbers committed events
(``job_events.seq``) one pass at a time under a lock, so every reader's snapshot holds a
gap-free prefix of the numbering: paging by ``seq > cursor`` never skips an event and
returns each once. A transaction still open is invisible to the sequencer; its events are
numbered when it has committed, after the events that committed before it, and it holds
back nobody else's. Readers run the sequencer themselves before reading (a single index
probe when nothing is pending), and the relay runs it every pass.

SQLite has one writer at a time, so ``id`` order already is commit order: it is the
position there and nothing is numbered.

:func:`announce_commits` tells readers that waiting is over: it calls a hook (the
platform's sends one Redis ``PUBLISH``, :class:`conveyor.delivery.wakeups.Announcer`) once
per transaction that wrote to the outbox, after it committed, so readers re-read at once
instead of at their next poll.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, event, select
from sqlalchemy.pool import ConnectionPoolEntry

from conveyor.store.db.dialect import is_sqlite, pg_statements
from conveyor.store.db.schema import job_events

__all__ = [
    "EventCursor",
    "announce_commits",
    "event_position",
    "outbox_committed",
    "resolve_cursor",
    "sequence_events",
]

log = logging.getLogger("conveyor.events")

# Events numbered per sequencer transaction: bounds one pass's locks and WAL.
SEQUENCE_BATCH = 5000


@dataclass(frozen=True)
class EventCursor:
    """Where a reader resumes: after position ``after``, or, for a cursor issued before
    positions were numbered (``"txid:id"``), right after the event ``legacy_id``."""

    after: int = 0
    legacy_id: int | None = None


def event_position(bind: Engine | Connection) -> ColumnElement[int]:
    """The column readers page by: ``seq`` on Postgres, ``id`` on SQLite."""
    return job_events.c.id if is_sqlite(bind) else job_events.c.seq


def resolve_cursor(conn: Connection, cursor: EventCursor) -> int:
    """The position after which ``cursor`` resumes.

    A ``"txid:id"`` cursor maps to the position of event ``id``: migration 0009 numbered
    the existing events in the (txid, id) order the old readers used, so this resumes
    exactly where the old reader was. An event since purged maps to the beginning (a
    reader may see again what is left, but skips nothing).
    """
    if cursor.legacy_id is None:
        return cursor.after
    if is_sqlite(conn):
        return cursor.legacy_id
    seq = conn.execute(select(job_events.c.seq).where(job_events.c.id == cursor.legacy_id)).scalar()
    return int(seq) if seq is not None else 0


def sequence_events(bind: Engine | Connection) -> int:
    """Number every event committed so far (Postgres; a no-op on SQLite); returns how many.

    Runs in transactions of its own: on ``bind`` when that is an engine or a connection
    outside a transaction, else on another connection from ``bind``'s pool, because the
    sequencer's lock lasts until its transaction ends and must not wait for the caller's.
    """
    if is_sqlite(bind):
        return 0
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return _sequence(conn)
    if bind.in_transaction():
        with bind.engine.connect() as conn:
            return _sequence(conn)
    return _sequence(bind)


def _sequence(conn: Connection) -> int:
    total = 0
    while True:
        with conn.begin():
            n = int(conn.execute(pg_statements(conn).sequence_events, {"limit": SEQUENCE_BATCH}).scalar_one())
        total += n
        if n < SEQUENCE_BATCH:
            return total


# -- wake-ups after commit ----------------------------------------------------------------

# Kept in the pooled connection's info (it outlives a Connection): what its transaction did.
_STATE = "conveyor_outbox"
_WROTE = "wrote"  # the open transaction inserted events
_COMMITTED = "committed"  # ... and committed: announce once the commit has returned
_announcers: weakref.WeakKeyDictionary[Engine, Callable[[], None]] = weakref.WeakKeyDictionary()
_INSERT = re.compile(r'\bINSERT\s+INTO\s+(?:"?\w+"?\.)?"?\w*job_events"?[\s(]', re.IGNORECASE)


@functools.lru_cache(maxsize=512)
def _writes_outbox(statement: str) -> bool:
    # Every writer (Core inserts, the one-statement submit and succeed, bulk submits) names
    # the table in its SQL (on SQLite with the schema's prefix); statements are few and
    # cached, so this is a dict hit per execute.
    return _INSERT.search(statement) is not None


def announce_commits(engine: Engine, announce: Callable[[], None]) -> None:
    """Call ``announce()`` once per transaction on ``engine`` that inserted events, after it
    committed, never for one rolled back.

    SQLAlchemy has no event after a commit, only before it; so the call comes at the first
    of: the connection going back to the pool (``with engine.begin()`` ends there at once),
    or the next transaction beginning on it. ``announce`` must not raise or block (it runs
    in the pool's checkin); a failure is logged at debug and forgotten: readers poll too.
    Events written outside SQLAlchemy's execution are announced by their writer
    (:func:`outbox_committed`).
    """

    def after_execute(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        info = _info(conn)
        if info is not None and _writes_outbox(statement):
            info[_STATE] = _WROTE

    def on_commit(conn: Connection) -> None:
        info = _info(conn)
        if info is not None and info.get(_STATE) == _WROTE:
            info[_STATE] = _COMMITTED

    def on_rollback(conn: Connection) -> None:
        info = _info(conn)
        if info is not None and info.get(_STATE) == _WROTE:
            del info[_STATE]

    def on_begin(conn: Connection) -> None:
        info = _info(conn)
        if info is not None and info.pop(_STATE, None) == _COMMITTED:
            _call(announce)

    def on_checkin(_dbapi: Any, record: ConnectionPoolEntry) -> None:
        if record is not None and record.info.pop(_STATE, None) == _COMMITTED:
            _call(announce)

    _announcers[engine] = announce
    event.listen(engine, "after_cursor_execute", after_execute)
    event.listen(engine, "commit", on_commit)
    event.listen(engine, "rollback", on_rollback)
    event.listen(engine, "begin", on_begin)
    event.listen(engine.pool, "checkin", on_checkin)


def _info(conn: Connection) -> dict[Any, Any] | None:
    """The pooled connection's info, or None when the connection cannot give it (invalidated
    by a lost server, its transaction still to be rolled back): a hook never raises into the
    rollback or commit it observes."""
    try:
        return conn.info
    except Exception:
        return None


def outbox_committed(engine: Engine) -> None:
    """Announce events committed on ``engine`` outside SQLAlchemy's execution (the lane's
    autocommit statements), as :func:`announce_commits` does for the others."""
    announce = _announcers.get(engine)
    if announce is not None:
        _call(announce)


def _call(announce: Callable[[], None]) -> None:
    try:
        announce()
    except Exception as exc:  # a hint lost: readers find the events at their next poll
        log.debug("outbox wake-up not sent (%s)", type(exc).__name__)
