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
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, Connection, Engine, select

from conveyor.store.db.dialect import is_sqlite, pg_statements
from conveyor.store.db.schema import job_events

__all__ = ["EventCursor", "event_position", "resolve_cursor", "sequence_events"]

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
