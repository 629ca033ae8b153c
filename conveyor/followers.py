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

Settled right after the holder's terminal commit (:meth:`Followers.resolve`, called by
``Platform.finished``) and, as the safety net for a crash in between, by the reconciler.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, exists, insert, select, update

from conveyor.db import schema as s
from conveyor.db.dialect import db_now, is_sqlite
from conveyor.db.engine import reading
from conveyor.db.schema import dedup_followers, jobs
from conveyor.errors import PermanentError
from conveyor.store import NewJob, Row, new_event

if TYPE_CHECKING:
    from conveyor.platform import Burial, Platform

log = logging.getLogger("conveyor.followers")

FLOW_OPTIONS = ("chain", "link", "chord", "group_id")


def has_flow(options: dict[str, Any]) -> bool:
    """Whether something waits on this job itself: a chain, callbacks or a chord/group."""
    return any(options.get(k) for k in FLOW_OPTIONS)


class Followers:
    """Creates followers in a submit's transaction and settles them when holders end."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def follow(self, conn: Connection, new: NewJob, holder: str) -> bool:
        """Store ``new`` as a follower of ``holder`` in ``conn``'s transaction.

        False if a job with its id exists already (a redelivered copy of the same call).
        """
        new.status, new.published_epoch, new.follows = s.WAITING_DEDUP, None, holder
        _, created = self.platform.store.insert(conn, new)
        if not created:
            new.status, new.follows = s.QUEUED, None
            return False
        conn.execute(insert(dedup_followers).values(job_id=new.id, holder=holder, created_at=db_now()))
        body = {"stage": new.stage, "holder": holder, "dedup_id": new.dedup_key}
        self.platform.store.emit(conn, [new_event(new.id, "job.following", body)])
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

    # -- settling ---------------------------------------------------------------------------

    def resolve(self, holder: str) -> int:
        """Settle every follower of ``holder`` if the holder is terminal (or gone)."""
        p = self.platform
        with reading(p.engine) as conn:
            row = p.store.get(conn, holder)
            if row is not None and row["status"] not in s.TERMINAL:
                return 0
            ids = list(
                conn.execute(
                    select(dedup_followers.c.job_id)
                    .join(jobs, jobs.c.id == dedup_followers.c.job_id)
                    .where(dedup_followers.c.holder == holder, jobs.c.status == s.WAITING_DEDUP)
                ).scalars()
            )
        settled = 0
        for job_id in ids:
            try:
                settled += self._settle(str(job_id), holder, row)
            except Exception:  # the reconciler settles it on a later pass
                log.warning("could not settle follower %s of %s", job_id, holder, exc_info=True)
        return settled

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

    def _settle(self, job_id: str, holder: str, holder_row: Row | None) -> int:
        p = self.platform
        status = None if holder_row is None else str(holder_row["status"])
        burial: Burial | None = None
        continuation: list[NewJob] = []
        requeued = False
        with p.engine.begin() as conn:
            q = select(jobs).where(jobs.c.id == job_id, jobs.c.status == s.WAITING_DEDUP)
            if not is_sqlite(conn):
                q = q.with_for_update(skip_locked=True)
            row = conn.execute(q).mappings().one_or_none()
            if row is None:
                return 0
            if status in (s.SUCCEEDED, s.SKIPPED):
                assert holder_row is not None
                result = holder_row["result"]
                p.store.finish(
                    conn,
                    row,
                    s.SUCCEEDED,
                    from_status=(s.WAITING_DEDUP,),
                    topic="job.succeeded",
                    body={"deduplicated_into": holder},
                )
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(result=result))
                continuation = self._continue(conn, row, result)
            elif status in (s.DEAD, None):
                cause = "no longer exists" if holder_row is None else f"died: {holder_row['last_error']}"
                message = f"deduplicated into job {holder}, which {cause}"[:2000]
                burial = p.bury(
                    conn, row, error=PermanentError(message), message=message, from_status=(s.WAITING_DEDUP,)
                )
            else:
                requeued = self._take_over(conn, row, holder)
        if burial is not None:
            p.after_burial(burial)
        elif continuation or status in (s.SUCCEEDED, s.SKIPPED):
            assert holder_row is not None
            p.publish_continuations(continuation)
            p.count_in_chord(row, "SUCCESS", holder_row["result"])
            self._store_result(row, holder_row["result"])
            p.finished(job_id, s.SUCCEEDED, dedup_key=row["dedup_key"])
        elif requeued:
            p.republish_if_queued(job_id)
        return 1

    def _continue(self, conn: Connection, row: Row, result: Any) -> list[NewJob]:
        """The follower's flow goes on with the holder's result, as if it had run."""
        p = self.platform
        options = row["options"] or {}
        task_id = row["origin_task_id"] or row["id"]
        extra = {"parent_id": task_id, "root_id": options.get("root_id") or task_id}
        created, _, _ = p.next_jobs(options.get("chain") or [], options.get("link") or [], row, result, extra)
        return p.insert_continuations(conn, created, upstream=str(row["id"]))

    def _take_over(self, conn: Connection, row: Row, holder: str) -> bool:
        """The holder was cancelled or expired: the follower takes the dedup id and runs,
        or follows the live job that took it meanwhile. True when it was queued to run."""
        p = self.platform
        spec = p.stages.get(row["stage"])
        mode = spec.dedup.mode if spec is not None and spec.dedup is not None else "simple"
        other = None
        if row["dedup_key"]:
            other = p.deduper.retake(conn, row["dedup_key"], str(row["id"]), now=p.deduper.clock(), mode=mode)
        if other is not None:
            conn.execute(
                update(dedup_followers).where(dedup_followers.c.job_id == row["id"]).values(holder=other)
            )
            body = {"stage": row["stage"], "holder": other, "previous_holder": holder}
            p.store.emit(conn, [new_event(row["id"], "job.following", body)])
            return False
        conn.execute(
            update(jobs)
            .where(jobs.c.id == row["id"], jobs.c.status == s.WAITING_DEDUP)
            .values(status=s.QUEUED, run_at=db_now(), published_at=None, updated_at=db_now())
        )
        body = {"stage": row["stage"], "previous_holder": holder, "holder_status": "ended without a result"}
        p.store.emit(conn, [new_event(row["id"], "job.queued", body)])
        return True

    def _store_result(self, row: Row, result: Any) -> None:
        """An ``AsyncResult`` of the follower's task id sees the holder's result."""
        origin = row["origin_task_id"]
        if not origin:
            return
        try:
            self.platform.app.backend.store_result(origin, result, "SUCCESS")
        except Exception:
            log.warning("could not store the result of follower %s", row["id"], exc_info=True)


__all__ = ["FLOW_OPTIONS", "Followers", "has_flow"]
