"""Every difference between Postgres and SQLite lives here.

* Time: Postgres stores ``timestamptz``; SQLite stores integer milliseconds since the epoch.
  Either way Python sees aware UTC datetimes, and every comparison uses the database clock
  (:class:`db_now`), never the caller's.
* Event positions: on Postgres a sequencer numbers events after they commit (``seq``, see
  :mod:`conveyor.store.events`); SQLite serialises writers, so ``id`` order already is commit order.
* Mutual exclusion for the relay: a Postgres advisory lock; on SQLite an ``flock`` file.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import functools
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Engine,
    Float,
    Table,
    bindparam,
    event,
    select,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.selectable import TextualSelect
from sqlalchemy.types import TypeDecorator, TypeEngine

from conveyor.errors import DatabaseBusy
from conveyor.store.db.namespace import schema_of

UTC = dt.UTC
log = logging.getLogger("conveyor.db")


class Timestamp(TypeDecorator[dt.datetime]):
    """An aware UTC datetime: ``timestamptz`` on Postgres, epoch milliseconds on SQLite."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(BigInteger())
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        if dialect.name == "sqlite":
            return int(value.timestamp() * 1000)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return dt.datetime.fromtimestamp(int(value) / 1000, tz=UTC)
        assert isinstance(value, dt.datetime)
        return value.astimezone(UTC)


class db_now(FunctionElement[dt.datetime]):
    """The database's clock, now (``clock_timestamp()`` on Postgres)."""

    type = Timestamp()
    inherit_cache = True


class db_now_plus(FunctionElement[dt.datetime]):
    """The database's clock plus a number of seconds (a bound float)."""

    type = Timestamp()
    inherit_cache = True


class db_now_ms(FunctionElement[int]):
    """The database's clock, now, as integer milliseconds since the epoch."""

    type = BigInteger()
    inherit_cache = True


_SQLITE_NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"


@compiles(db_now_ms, "postgresql")
def _now_ms_pg(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    return "(SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint)"


@compiles(db_now_ms, "sqlite")
def _now_ms_sqlite(element: db_now_ms, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW_MS


# As scalar subqueries: Postgres evaluates them once (an InitPlan), so unlike a bare
# volatile clock_timestamp() they can bound index scans in the relay's queries.
@compiles(db_now, "postgresql")
def _now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "(SELECT clock_timestamp())"


@compiles(db_now, "sqlite")
def _now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW_MS


@compiles(db_now_plus, "postgresql")
def _now_plus_pg(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    return f"(SELECT clock_timestamp() + make_interval(secs => {compiler.process(element.clauses, **kw)}))"


@compiles(db_now_plus, "sqlite")
def _now_plus_sqlite(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    return f"({_SQLITE_NOW_MS} + CAST(({compiler.process(element.clauses, **kw)}) * 1000 AS INTEGER))"


def database_clock(engine: Engine) -> float:
    """The database's clock, now, in seconds since the epoch (one round trip)."""
    with engine.connect() as conn:
        return int(conn.execute(select(db_now_ms())).scalar_one()) / 1000


def is_sqlite(bind: Engine | Connection) -> bool:
    """True when ``bind`` talks to SQLite."""
    return bind.dialect.name == "sqlite"


# Execution options read at BEGIN (SQLite; Postgres ignores them): a read-only transaction
# takes no write lock; a write that must not queue behind a long transaction waits at most
# this many seconds for the writer, then raises DatabaseBusy.
READ_ONLY = "conveyor_read_only"
WRITE_WAIT = "conveyor_write_wait"


def configure_engine(engine: Engine) -> None:
    """Per-dialect connection setup: SQLite gets WAL, a busy timeout and ``BEGIN IMMEDIATE``.

    ``BEGIN IMMEDIATE`` takes the write lock up front; a deferred transaction that reads
    and then writes can fail with SQLITE_BUSY halfway, which would look like a lost race.
    """
    if not is_sqlite(engine):
        return
    writer_lock = _writer_lock(str(engine.url.database))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        dbapi_conn = conn.connection.dbapi_connection
        options = conn.get_execution_options()
        if options.get(READ_ONLY):
            # WAL readers never wait for the writer (a stage body may hold it for long).
            conn.exec_driver_sql("BEGIN")
            return
        wait = options.get(WRITE_WAIT)
        # Threads of one process queue on a lock instead of SQLite's sleeping busy handler.
        if not writer_lock.acquire(timeout=-1 if wait is None else float(wait)):
            raise DatabaseBusy("the SQLite writer is busy (a transaction holds it)")
        try:
            if wait is not None:
                conn.exec_driver_sql(f"PRAGMA busy_timeout={max(1, int(float(wait) * 1000))}")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except Exception as exc:
            writer_lock.release()
            if wait is not None and "locked" in str(exc):
                raise DatabaseBusy("the SQLite writer is busy (another process holds it)") from exc
            raise
        except BaseException:
            writer_lock.release()
            raise
        if isinstance(dbapi_conn, LockingConnection):
            dbapi_conn.held = writer_lock
            dbapi_conn.held_since = time.monotonic()


_writer_locks: dict[str, threading.Lock] = {}
_writer_locks_guard = threading.Lock()


def _writer_lock(path: str) -> threading.Lock:
    with _writer_locks_guard:
        return _writer_locks.setdefault(path, threading.Lock())


# SQLite has one writer: a write transaction held longer than this stalls every other
# writer (submits, claims, heartbeats) for as long, so it is logged as a warning.
SLOW_WRITE = 2.0


class LockingConnection(sqlite3.Connection):
    """A sqlite3 connection that releases the in-process writer lock when its transaction ends."""

    held: threading.Lock | None = None
    held_since = 0.0

    def _release(self) -> None:
        lock, self.held = self.held, None
        if lock is not None:
            lock.release()
            held = time.monotonic() - self.held_since
            if held > SLOW_WRITE:
                log.warning("SQLite write lock held for %.1f s (more than %.0f s)", held, SLOW_WRITE)

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._release()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._release()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()


# -- event positions -------------------------------------------------------------------

# The writer's transaction id, the events' position before migration 0009 (which drops the
# column); only migrations use it.
EVENT_TXID_DEFAULT_PG = "(pg_current_xact_id()::text)::bigint"

# -- singleton locks -------------------------------------------------------------------


# A holder cut off mid-transaction (its host or link gone) keeps the lock until Postgres
# ends that transaction: idle this long between statements, it is ended, whatever the
# server's own setting (which must not be this short for stage bodies' transactions).
SINGLETON_IDLE_LIMIT_MS = 5000


def try_singleton_lock(conn: Connection, key: int, lock_dir: Path) -> bool:
    """Take a lock held until ``conn``'s transaction ends (Postgres) or the process exits.

    On Postgres the transaction is ended by the server once it has been idle for
    ``SINGLETON_IDLE_LIMIT_MS``, so a holder that vanished frees the lock within seconds.
    On SQLite there is one database file per home, so an ``flock`` in the home is enough.
    """
    if not is_sqlite(conn):
        q = text(
            "SELECT set_config('idle_in_transaction_session_timeout', :idle, true), "
            "pg_try_advisory_xact_lock(:k)"
        )
        return bool(conn.execute(q, {"k": key, "idle": str(SINGLETON_IDLE_LIMIT_MS)}).one()[1])
    return _file_lock(lock_dir / f"lock-{key}")


_held_files: dict[Path, int] = {}


def try_flock(path: Path) -> int | None:
    """The descriptor of ``path`` holding an exclusive ``flock`` on it (closing it lets go),
    or None while another holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _file_lock(path: Path) -> bool:
    if path in _held_files:
        return True
    fd = try_flock(path)
    if fd is None:
        return False
    _held_files[path] = fd
    return True


# -- upserts ---------------------------------------------------------------------------


def relax_commit(conn: Connection) -> None:
    """Let this transaction commit without waiting for the WAL flush (Postgres).

    Only for writes that are safe to lose in a database crash because a later
    synchronous commit flushes them, or because redoing them is harmless (a progress
    state that the next attempt sets again). A no-op on SQLite.
    """
    if not is_sqlite(conn):
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")


def upsert(conn: Connection, table: Table) -> Any:
    """``INSERT`` with ``ON CONFLICT`` support for ``conn``'s dialect."""
    if is_sqlite(conn):
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    return pg_insert(table)


# -- sequences -------------------------------------------------------------------------


def next_seq(conn: Connection) -> int:
    """A number from the platform's sequence, increasing in assignment order.

    Postgres: a real sequence. SQLite: a counter row, safe because writers are serialised.
    """
    if not is_sqlite(conn):
        return int(conn.execute(pg_statements(conn).next_seq).scalar_one())
    conn.execute(
        text(
            "INSERT INTO conveyor_counters(name, value) VALUES ('seq', 1) "
            "ON CONFLICT(name) DO UPDATE SET value = value + 1"
        )
    )
    return int(conn.execute(text("SELECT value FROM conveyor_counters WHERE name = 'seq'")).scalar_one())


# -- Postgres hot paths ------------------------------------------------------------------
# The three writes every job makes (submit, claim, succeed), each as one prepared
# statement: a data-modifying CTE writes the row and its outbox event together. SQLite
# (one writer, no DML CTEs) uses the generic statements in conveyor.store.jobs. Table and
# function names are qualified with Conveyor's schema: a submit may run on a caller's
# connection, whose search_path knows nothing of it.

_JSON = JSON()


@dataclass(frozen=True)
class PgStatements:
    """The raw Postgres statements, qualified with one schema."""

    submit: TextClause
    claim: TextualSelect
    succeed: TextClause
    sequence_events: TextClause
    next_seq: TextClause


def pg_statements(conn: Connection) -> PgStatements:
    """The raw statements for the schema ``conn`` renders Conveyor's tables in."""
    return _pg_statements(schema_of(conn))


def submit_sql(schema: str) -> str:
    """The one-statement submit (the job row and its ``job.submitted`` event) for Conveyor's
    tables in ``schema``, with ``:name`` placeholders; :mod:`conveyor.store.db.lane` runs the same
    text with psycopg's."""
    s = f'"{schema}".'
    return f"""
    WITH j AS (
      INSERT INTO {s}jobs (id, stage, queue, status, priority, payload, label, idempotency_key, attempts,
                        max_attempts, run_at, expires_at, flow_id, parent_id, options, origin_task_id,
                        created_at, updated_at, celery_task_id, published_at, broker_epoch,
                        dedup_key, dedup_seq, owner, trace_context)
      VALUES (:id, :stage, :queue, 'queued', :priority, :payload, :label, :idempotency_key, 0,
              :max_attempts, clock_timestamp() + make_interval(secs => CAST(:delay AS float8)),
              CASE WHEN CAST(:expires_in AS float8) IS NULL THEN NULL
                   ELSE clock_timestamp() + make_interval(secs => CAST(:expires_in AS float8)) END,
              :flow_id, :parent_id, :options, :origin_task_id, clock_timestamp(), clock_timestamp(),
              :celery_task_id,
              CASE WHEN CAST(:broker_epoch AS text) IS NULL THEN NULL ELSE clock_timestamp() END,
              :broker_epoch, :dedup_key, :dedup_seq, :owner, :trace_context)
      ON CONFLICT DO NOTHING
      RETURNING id
    )
    INSERT INTO {s}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.submitted', :event, clock_timestamp() FROM j
    RETURNING job_id
    """


@functools.lru_cache(maxsize=8)
def _pg_statements(schema: str) -> PgStatements:
    s = f'"{schema}".'
    submit = text(submit_sql(schema)).bindparams(
        bindparam("payload", type_=_JSON),
        bindparam("options", type_=_JSON),
        bindparam("event", type_=_JSON),
        bindparam("trace_context", type_=JSON(none_as_null=True)),
        bindparam("delay", type_=Float()),
        bindparam("expires_in", type_=Float()),
    )
    succeed = text(
        f"""
    WITH u AS (
      UPDATE {s}jobs SET status = 'succeeded', result = :result, lease_owner = NULL,
             finished_at = clock_timestamp(), updated_at = clock_timestamp()
      WHERE id = :id AND status = 'running' AND attempts = :attempt
      RETURNING id
    )
    INSERT INTO {s}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.succeeded', :event, clock_timestamp() FROM u
    RETURNING job_id
    """
    ).bindparams(bindparam("result", type_=_JSON), bindparam("event", type_=_JSON))
    return PgStatements(
        submit=submit,
        # One round trip, in autocommit (migration 0007: it commits synchronously, so a
        # database crash never reissues an attempt number; conveyor.store.db.lane runs it).
        # The function's body finds its tables through the search_path of Conveyor's own
        # connections, the only ones that claim.
        claim=text(f"SELECT * FROM {s}conveyor_claim(:id, :owner, :task_id)").columns(
            payload=_JSON, options=_JSON, result=_JSON, progress=_JSON, trace_context=_JSON
        ),
        succeed=succeed,
        # Numbers up to ``limit`` committed, unnumbered events; the function (migration
        # 0009) holds the sequencer's lock until the calling transaction ends: commit next.
        sequence_events=text(f"SELECT {s}conveyor_sequence_events(:limit)"),
        next_seq=text(f"SELECT nextval('{s}conveyor_seq')"),
    )
