"""Plain functions behind the self-check stages."""

from __future__ import annotations

from sqlalchemy import Connection, Engine, func, insert, select

from conveyor.store.db.dialect import db_now
from tasks.demo.models import effects


def record_effect(conn: Connection, *, job_id: str, stage: str, attempt: int, note: str | None) -> None:
    """Write one effect row in the caller's transaction."""
    conn.execute(
        insert(effects).values(job_id=job_id, stage=stage, attempt=attempt, note=note, created_at=db_now())
    )


def mark(engine: Engine, *, job_id: str, stage: str, attempt: int, note: str, hold: float = 0.0) -> None:
    """A marker row committed on its own, visible at once (tests order events by it); with
    ``hold``, its transaction first spends that many seconds in the database (Postgres)."""
    with engine.begin() as conn:
        if hold:
            conn.execute(select(func.pg_sleep(hold)))
        record_effect(conn, job_id=job_id, stage=stage, attempt=attempt, note=note)


def fix(engine: Engine, key: str) -> None:
    """Fix the cause of ``conveyor.demo.fixable``'s failures for ``key``."""
    mark(engine, job_id=key[:36], stage="conveyor.demo.fixable", attempt=0, note=f"fixed:{key}")


def is_fixed(conn: Connection, key: str) -> bool:
    """Whether :func:`fix` ran for ``key``."""
    found = conn.execute(select(effects.c.id).where(effects.c.note == f"fixed:{key}").limit(1)).first()
    return found is not None


def square(n: int) -> int:
    """The demo's arithmetic."""
    return n * n
