"""The hot path's two statements on Postgres, below SQLAlchemy's execution layer.

Every job runs one claim and one completion. Through a SQLAlchemy ``Connection`` each cost
about 0.3 ms of Python before and after its round trip (a connection object, an
isolation-level switch and its reset, statement compilation lookups, result metadata);
here each is a pooled psycopg connection in autocommit, a server-side prepared statement
and a dict row, with the same pool, connect arguments and error classification
(:func:`conveyor.errors.is_connection_loss` sees SQLAlchemy's own ``DBAPIError``).
Measured by ``bench/throughput.py`` (issue #16).
"""

from __future__ import annotations

import functools
from typing import Any

import psycopg
import sqlalchemy.exc
from psycopg.rows import dict_row
from psycopg.types.json import Json
from sqlalchemy import Engine


@functools.lru_cache(maxsize=8)
def _statements(schema: str) -> tuple[str, str]:
    s = f'"{schema}".'
    claim = f"SELECT * FROM {s}conveyor_claim(%(id)s, %(owner)s, %(task_id)s)"
    succeed = f"""
    WITH u AS (
      UPDATE {s}jobs SET status = 'succeeded', result = %(result)s, lease_owner = NULL,
             finished_at = clock_timestamp(), updated_at = clock_timestamp()
      WHERE id = %(id)s AND status = 'running' AND attempts = %(attempt)s
      RETURNING id
    )
    INSERT INTO {s}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.succeeded', %(event)s, clock_timestamp() FROM u
    RETURNING job_id
    """
    return claim, succeed


class Lane:
    """Claim and completion as single autocommit statements on one engine's pool."""

    def __init__(self, engine: Engine, schema: str) -> None:
        self.engine = engine
        self.claim_sql, self.succeed_sql = _statements(schema)

    def claim(self, job_id: str, *, owner: str, task_id: str) -> dict[str, Any] | None:
        """The claim compare-and-set (``conveyor_claim``): the running row, or None."""
        rows = self._run(self.claim_sql, {"id": job_id, "owner": owner, "task_id": task_id})
        return rows[0] if rows else None

    def succeed(self, job_id: str, attempt: int, result: Any, stage: str) -> bool:
        """``running → succeeded`` for ``attempt`` with its ``job.succeeded`` event; False
        when the attempt no longer owns the job (fenced off)."""
        params = {"id": job_id, "attempt": attempt, "result": Json(result), "event": Json({"stage": stage})}
        return bool(self._run(self.succeed_sql, params))

    def _run(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        fairy = self.engine.raw_connection()
        try:
            conn: psycopg.Connection[Any] = fairy.driver_connection  # type: ignore[assignment]
            try:
                conn.autocommit = True
                try:
                    with conn.cursor(row_factory=dict_row) as cur:
                        cur.execute(sql, params, prepare=True)
                        return cur.fetchall() if cur.description else []
                finally:
                    if not conn.closed:
                        conn.autocommit = False
            except psycopg.Error as exc:
                lost = conn.closed or self.engine.dialect.is_disconnect(exc, fairy, None)  # type: ignore[arg-type]
                if lost:
                    fairy.invalidate(exc)
                raise sqlalchemy.exc.DBAPIError.instance(
                    sql, params, exc, psycopg.Error, connection_invalidated=bool(lost)
                ) from exc
        finally:
            fairy.close()


__all__ = ["Lane"]
