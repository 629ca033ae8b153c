"""The hot path's statements on Postgres, below SQLAlchemy's execution layer.

Every job runs one submit, one claim and one completion. Through a SQLAlchemy
``Connection`` each cost about 0.3 ms of Python around its round trip (a connection
object, an isolation-level switch and its reset, statement compilation lookups, result
metadata), and a pool checkout and return alone about 0.1 ms. Here the process's main
thread (a prefork child runs its jobs there) keeps one connection of the engine's pool
(same connect arguments and events) in autocommit, with server-side prepared statements
and rows named once per statement; other threads, which may be short-lived (a web
server's request threads), take a pooled connection per call and give it back.

Errors are classified as SQLAlchemy's (:func:`conveyor.errors.is_connection_loss` sees
its ``DBAPIError``, marked as Conveyor's own as the engine's are), and a lost connection
is invalidated and replaced on the next call.
A connection idle for ``PING_AFTER`` seconds is pinged first, as a pool's pre-ping would,
so a server that dropped it meanwhile costs a reconnect, not a failed claim. With
``db_pool_size=0`` (no pooling) nothing is kept. Measured by ``bench/throughput.py``
(issue #16).
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
import sqlalchemy.exc
from psycopg.rows import tuple_row
from psycopg.types.json import Json
from sqlalchemy import Engine
from sqlalchemy.pool import NullPool

from conveyor.errors import mark_own
from conveyor.store.db.dialect import submit_sql

PING_AFTER = 30.0


@functools.lru_cache(maxsize=8)
def _statements(schema: str) -> tuple[str, str, str]:
    s = f'"{schema}".'
    # conveyor.store.db.dialect's submit statement, with psycopg's named placeholders.
    submit = re.sub(r"(?<!:):(\w+)", r"%(\1)s", submit_sql(schema))
    # Positional parameters on the per-job statements: cheaper for psycopg than named ones.
    claim = f"SELECT * FROM {s}conveyor_claim(%s, %s, %s)"  # id, owner, task id
    succeed = f"""
    WITH u AS (
      UPDATE {s}jobs SET status = 'succeeded', result = %s, lease_owner = NULL,
             finished_at = clock_timestamp(), updated_at = clock_timestamp()
      WHERE id = %s AND status = 'running' AND attempts = %s
      RETURNING id
    )
    INSERT INTO {s}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.succeeded', %s, clock_timestamp() FROM u
    RETURNING job_id
    """  # result, id, attempt, event
    return submit, claim, succeed


class Lane:
    """Submit, claim and completion as single autocommit statements on one engine's pool."""

    def __init__(self, engine: Engine, schema: str, *, announce: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.announce = announce  # after a statement that committed an event (never raises)
        self.submit_sql, self.claim_sql, self.succeed_sql = _statements(schema)
        self._keep = not isinstance(engine.pool, NullPool)
        self._local = threading.local()
        # Column names per statement: psycopg's dict rows describe every column of every
        # result (a third of a claim's client CPU for the ~40 columns of a job row).
        self._names: dict[str, list[str]] = {}

    def submit(self, params: dict[str, Any]) -> bool:
        """The one-statement submit (:meth:`conveyor.store.jobs.JobStore.submit_params`): the job
        row and its ``job.submitted`` event, committed; False if the id or idempotency key
        exists."""
        values = dict(params)
        for name in ("payload", "options", "event"):
            values[name] = Json(values[name])
        if values.get("trace_context") is not None:
            values["trace_context"] = Json(values["trace_context"])
        created = bool(self._run(self.submit_sql, values))
        if created:
            self.announce()  # the outbox has a new event: a stream waiting for it reads now
        return created

    def claim(self, job_id: str, *, owner: str, task_id: str) -> dict[str, Any] | None:
        """The claim compare-and-set (``conveyor_claim``): the running row, or None."""
        rows = self._run(self.claim_sql, (job_id, owner, task_id))
        return rows[0] if rows else None

    def succeed(self, job_id: str, attempt: int, result: Any, stage: str) -> bool:
        """``running → succeeded`` for ``attempt`` with its ``job.succeeded`` event; False
        when the attempt no longer owns the job (fenced off)."""
        ok = bool(self._run(self.succeed_sql, (Json(result), job_id, attempt, Json({"stage": stage}))))
        if ok:
            self.announce()
        return ok

    def close(self) -> None:
        """Give this thread's kept connection back to the pool."""
        fairy = getattr(self._local, "fairy", None)
        self._local.fairy = None
        if fairy is not None:
            self._release(fairy)

    def _run(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[dict[str, Any]]:
        fairy = self._take()
        conn: psycopg.Connection[Any] = fairy.driver_connection
        cur: psycopg.Cursor[tuple[Any, ...]] = self._local.cursor
        try:
            cur.execute(sql, params, prepare=True)
            if cur.pgresult is None or not cur.pgresult.nfields:
                return []
            rows = cur.fetchall()
            names = self._names.get(sql)
            if rows and (names is None or len(names) != len(rows[0])):  # new, or the table changed
                names = self._names[sql] = [c.name for c in cur.description or ()]
            return [dict(zip(names or (), row, strict=True)) for row in rows]
        except psycopg.Error as exc:
            lost = conn.closed or self.engine.dialect.is_disconnect(exc, fairy, None)  # type: ignore[arg-type]
            if lost:
                self._local.fairy = None
                fairy.invalidate(exc)
                fairy.close()
            raise mark_own(
                sqlalchemy.exc.DBAPIError.instance(
                    sql, params, exc, psycopg.Error, connection_invalidated=bool(lost)
                )
            ) from exc
        finally:
            self._local.used = time.monotonic()
            if not (self._keep and threading.current_thread() is threading.main_thread()) and (
                self._local.fairy is fairy
            ):
                self._local.fairy = None
                self._release(fairy)

    def _take(self) -> Any:
        fairy = getattr(self._local, "fairy", None)
        if fairy is not None and time.monotonic() - self._local.used > PING_AFTER:
            try:
                fairy.driver_connection.execute("SELECT 1")
            except psycopg.Error as exc:
                self._local.fairy = None
                fairy.invalidate(exc)
                fairy.close()
                fairy = None
        if fairy is None:
            try:
                fairy = self.engine.raw_connection()
            except psycopg.Error as exc:  # raw_connection() leaves connect errors unwrapped
                raise mark_own(
                    sqlalchemy.exc.DBAPIError.instance(
                        None, None, exc, psycopg.Error, connection_invalidated=True
                    )
                ) from exc
            try:
                fairy.driver_connection.autocommit = True  # type: ignore[union-attr]
                self._local.cursor = fairy.driver_connection.cursor(row_factory=tuple_row)  # type: ignore[union-attr]
            except BaseException:
                fairy.close()
                raise
            self._local.fairy = fairy
        return fairy

    @staticmethod
    def _release(fairy: Any) -> None:
        conn = fairy.driver_connection
        try:
            if not conn.closed:
                conn.autocommit = False  # the pool's other users expect transactions
        finally:
            fairy.close()


__all__ = ["Lane"]
