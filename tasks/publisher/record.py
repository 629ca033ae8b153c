"""A post's record follows its job: these are the moves the stages and the platform's hooks
make on ``publisher_jobs``, each on the caller's connection (it commits with their work)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, insert, select, update

from conveyor.errors import describe
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import job_events
from conveyor.store.jobs import new_event
from tasks.publisher import tables as t

MAX_ERROR = 500


def post_id_of(payload: Any) -> str | None:
    """The record a stored payload names (None: too broken to name one)."""
    value = payload.get("post_id") if isinstance(payload, Mapping) else None
    return value if isinstance(value, str) and 0 < len(value) <= 36 else None


def error_text(error: BaseException) -> str:
    """What the record keeps of an error: its type and message, bounded (the connectors'
    messages never carry a token or a caption)."""
    return describe(error)[:MAX_ERROR]


def get(conn: Connection, post_id: str, *, lock: bool = False) -> Mapping[str, Any] | None:
    """One record, or None (locked for the transaction with ``lock``)."""
    query = select(t.posts).where(t.posts.c.id == post_id)
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update()
    return conn.execute(query).mappings().first()


def move(conn: Connection, post_id: str, status: str, *, only_from: tuple[str, ...], **values: Any) -> bool:
    """``only_from → status`` (and ``values``); False when the record was elsewhere."""
    res = conn.execute(
        update(t.posts)
        .where(t.posts.c.id == post_id, t.posts.c.status.in_(only_from))
        .values(status=status, updated_at=db_now(), **values)
    )
    return res.rowcount == 1


def event(conn: Connection, job_id: str, topic: str, body: Mapping[str, Any]) -> None:
    """An outbox event of ``job_id`` in this transaction (the seed's hooks)."""
    conn.execute(insert(job_events).values(created_at=db_now()), [dict(new_event(job_id, topic, dict(body)))])


# -- the platform's hooks -----------------------------------------------------------------


def on_dead(conn: Connection, payload: Any, error: BaseException) -> None:
    """In the dead-letter transaction: ``failed`` with the error (a completed record stays);
    a first comment's failure is announced (``publisher.first_comment_failed``), never its
    parent's."""
    post_id = post_id_of(payload)
    if post_id is None:
        return
    row = get(conn, post_id)
    if row is None:
        return
    move(conn, post_id, t.FAILED, only_from=(t.PENDING, t.RUNNING), last_error=error_text(error))
    if row["type"] == t.FIRST_COMMENT and row["job_id"]:
        body = {"post_id": row["parent_id"], "comment_id": post_id, "error": type(error).__name__}
        event(conn, row["job_id"], "publisher.first_comment_failed", body)


def on_retry(conn: Connection, payload: Any) -> None:
    """In a DLQ retry's (the replay's) transaction: ``pending`` again, attempts from 0."""
    post_id = post_id_of(payload)
    if post_id is not None:
        move(conn, post_id, t.PENDING, only_from=(t.FAILED,), attempts=0, last_error=None)


def on_stalled(conn: Connection, payload: Any, attempts: int) -> None:
    """An attempt whose worker was lost is taken over: ``pending`` until it starts again."""
    post_id = post_id_of(payload)
    if post_id is not None:
        move(conn, post_id, t.PENDING, only_from=(t.RUNNING,), last_error="its worker was lost")


def on_expired(conn: Connection, payload: Any) -> None:
    """The job expired before it ran: ``failed``."""
    post_id = post_id_of(payload)
    if post_id is not None:
        move(conn, post_id, t.FAILED, only_from=(t.PENDING,), last_error="expired before it ran")


__all__ = [
    "error_text",
    "event",
    "get",
    "move",
    "on_dead",
    "on_expired",
    "on_retry",
    "on_stalled",
    "post_id_of",
]
