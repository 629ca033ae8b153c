"""Dedup followers: a job of a flow that was deduplicated into a live holder.

A plain ``submit()`` of a duplicate just returns the holder. A chain link, a link callback,
a chord member or a call with a canvas-fixed task id cannot: something waits on *that*
job (the rest of the chain, the chord's counter, an ``AsyncResult``). Such a job is stored
as a *follower* (status ``waiting_dedup``, never published) and takes the holder's outcome
when the holder is terminal:

* succeeded or skipped: the follower succeeds with the holder's result and its flow goes
  on (next chain link, callbacks, its chord's counter, its ``AsyncResult``);
* dead (or purged): the follower is dead-lettered with a message naming the holder;
* cancelled or expired: the work was never done, so the follower takes the dedup id
  itself and runs (or follows whichever live job took the id meanwhile).

This module stores followers and finds them. Settling them is the worker side's
(:meth:`conveyor.worker.flow.Flow.resolve`), right after the holder's terminal commit and, as
the safety net for a crash in between, by the reconciler. A caller that ends or follows a
job reaches it through :class:`Settles`, given to it by the platform.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import Connection, exists, insert, select, update

from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import dedup_followers, jobs
from conveyor.store.jobs import JobStore, NewJob, new_event

FLOW_OPTIONS = ("chain", "link", "chord", "group_id")


def has_flow(options: dict[str, Any]) -> bool:
    """Whether something waits on this job itself: a chain, callbacks or a chord/group."""
    return any(options.get(k) for k in FLOW_OPTIONS)


class Settles(Protocol):
    """What happens once a job ended: its waiters are woken and its followers settled
    (:class:`conveyor.worker.flow.Flow`)."""

    def finished(self, job_id: str, status: str, *, dedup_key: str | None = None) -> None:
        """After a job's terminal transition committed."""

    def resolve(self, holder: str) -> int:
        """Settle every follower of ``holder`` if the holder is terminal (or gone)."""


class Followers:
    """Stores followers in a submit's transaction and finds the ones to settle."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def follow(self, conn: Connection, new: NewJob, holder: str) -> bool:
        """Store ``new`` as a follower of ``holder`` in ``conn``'s transaction.

        False if a job with its id exists already (a redelivered copy of the same call).
        """
        new.status, new.published_epoch, new.follows = s.WAITING_DEDUP, None, holder
        _, created = self.store.insert(conn, new)
        if not created:
            new.status, new.follows = s.QUEUED, None
            return False
        conn.execute(insert(dedup_followers).values(job_id=new.id, holder=holder, created_at=db_now()))
        body = {"stage": new.stage, "holder": holder, "dedup_id": new.dedup_key}
        self.store.emit(conn, [new_event(new.id, "job.following", body)])
        return True

    def convert(self, conn: Connection, job_id: str, holder: str) -> None:
        """Turn a queued job (a continuation sent back to run again) into a follower."""
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == s.QUEUED)
            .values(status=s.WAITING_DEDUP, published_at=None, updated_at=db_now())
        )
        conn.execute(dedup_followers.delete().where(dedup_followers.c.job_id == job_id))
        conn.execute(insert(dedup_followers).values(job_id=job_id, holder=holder, created_at=db_now()))

    # -- finding ------------------------------------------------------------------------

    def waiting_on(self, conn: Connection, holder: str) -> list[str]:
        """The followers of ``holder`` still waiting."""
        return [
            str(job_id)
            for job_id in conn.execute(
                select(dedup_followers.c.job_id)
                .join(jobs, jobs.c.id == dedup_followers.c.job_id)
                .where(dedup_followers.c.holder == holder, jobs.c.status == s.WAITING_DEDUP)
            ).scalars()
        ]

    def stuck_holders(self, conn: Connection, limit: int = 100) -> list[str]:
        """Holders that ended (or vanished) while followers still wait on them."""
        h = jobs.alias("holder_job")
        live = exists(
            select(h.c.id).where(h.c.id == dedup_followers.c.holder, h.c.status.not_in(list(s.TERMINAL)))
        )
        q = (
            select(dedup_followers.c.holder)
            .join(jobs, jobs.c.id == dedup_followers.c.job_id)
            .where(jobs.c.status == s.WAITING_DEDUP, ~live)
            .distinct()
            .limit(limit)
        )
        return [str(h) for h in conn.execute(q).scalars()]

    def purge(self, conn: Connection) -> int:
        """Forget links of followers that are settled or gone."""
        waiting = exists(
            select(jobs.c.id).where(jobs.c.id == dedup_followers.c.job_id, jobs.c.status == s.WAITING_DEDUP)
        )
        return int(conn.execute(dedup_followers.delete().where(~waiting)).rowcount or 0)


__all__ = ["FLOW_OPTIONS", "Followers", "Settles", "has_flow"]
