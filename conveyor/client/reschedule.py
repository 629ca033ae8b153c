"""Moving a job that has not started to another time.

A job waiting to be claimed (``queued``, ``retrying``, ``throttled``, ``waiting_lease``)
takes the new ``run_at`` and is unpublished, so the relay publishes it when it falls due; a
copy already in the broker reaches its claim early and is dropped there (the claim wants
``run_at <= now``). A parked job (``throttled``, ``waiting_lease``) goes back to ``queued``:
at its new time it asks for its window, slot or lease again. Once a job runs or has ended,
nothing changes and the answer is False.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection, case, update
from sqlalchemy.orm import Session, scoped_session

from conveyor.client import session_hooks
from conveyor.client.recorder import Recorder
from conveyor.delivery.connections import Connections
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.namespace import use_schema
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import JobStore, new_event

MOVABLE = (s.QUEUED, s.RETRYING, s.THROTTLED, s.WAITING_LEASE)


def reschedule_in(conn: Connection, store: JobStore, job_id: str, run_at: dt.datetime) -> bool:
    """In ``conn``'s transaction: move ``job_id`` to ``run_at`` (aware) if it has not started."""
    when = session_hooks.utc_or_none(run_at)
    assert when is not None
    res = conn.execute(
        update(jobs)
        .where(jobs.c.id == job_id, jobs.c.status.in_(MOVABLE))
        .values(
            run_at=when,
            published_at=None,
            status=case((jobs.c.status == s.RETRYING, s.RETRYING), else_=s.QUEUED),
            updated_at=db_now(),
        )
    )
    if res.rowcount != 1:
        return False
    store.emit(conn, [new_event(job_id, "job.rescheduled", {"run_at": when.isoformat()})])
    return True


def reschedule(
    connections: Connections,
    store: JobStore,
    recorder: Recorder,
    job_id: str,
    run_at: dt.datetime,
    *,
    session: Session | scoped_session[Any] | None = None,
) -> bool:
    """Move a job not yet claimed to ``run_at`` (in ``session``'s transaction if given);
    False once it runs or has ended. A job due by then is published after the commit."""
    if run_at.tzinfo is None:
        raise ValueError("run_at must be timezone-aware")

    def publish_if_due() -> None:
        if run_at <= dt.datetime.now(dt.UTC):
            try:
                recorder.republish_if_queued(job_id)
            except Exception:  # the relay publishes it on its next pass
                return

    if session is not None:
        joined = session_hooks.resolved(session)
        conn = use_schema(joined.connection(), connections.settings.db_schema)
        moved = reschedule_in(conn, store, job_id, run_at)
        if moved:
            session_hooks.after_commit(joined, publish_if_due, job_id, "reschedule")
        return moved
    with connections.engine.begin() as conn:
        moved = reschedule_in(conn, store, job_id, run_at)
    if moved:
        publish_if_due()
    return moved


__all__ = ["MOVABLE", "reschedule", "reschedule_in"]
