"""Lease keys, priority-aware preemption and cancellation.

A stage may declare a lease key (``"user:{user_id}"``): one job holds it at a time. A job
that cannot take it is parked in the database (``waiting_lease``, no pool slot), and the
release publishes the highest-priority parked job for the key. A job of higher priority
than a *preemptable* holder asks the holder to stop (a flag in Postgres plus a fast flag
in Redis): the holder raises :class:`~conveyor.errors.Preempted` at its next checkpoint,
releases the lease and is requeued without counting an attempt. A holder that reaches no
checkpoint within its grace period is interrupted by a worker control command that
signals exactly the child running that job and attempt. Only a preemptor whose request
is in flight waits inside its slot, woken by ``BLPOP`` on the key's wake list.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, and_, or_, select, update
from sqlalchemy.engine import RowMapping

from conveyor.db import schema as s
from conveyor.db.dialect import db_now, db_now_plus, next_seq, upsert
from conveyor.db.engine import reading
from conveyor.db.schema import jobs, leases
from conveyor.store import new_event

if TYPE_CHECKING:
    from conveyor.context import JobContext
    from conveyor.platform import Platform

log = logging.getLogger("conveyor.leases")

PREEMPT = "preempt"
CANCEL = "cancel"


@dataclass(frozen=True)
class Held:
    """A lease this attempt holds."""

    key: str
    token: int


class Leases:
    """Lease table operations and the stop flags (preempt/cancel) they drive."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    # -- keys ---------------------------------------------------------------------------

    def _flag(self, job_id: str) -> str:
        return f"{self.platform.settings.key_prefix}stop:{job_id}"

    def _wake(self, key: str) -> str:
        return f"{self.platform.settings.key_prefix}wake:{key}"

    # -- acquire / renew / release ------------------------------------------------------

    def try_acquire(
        self,
        conn: Connection,
        *,
        key: str,
        job_id: str,
        attempt: int,
        priority: int,
        preemptable: bool,
        token: int,
    ) -> RowMapping | None:
        """Take ``key`` for this attempt; None on success, else the current lease row.

        The lease is free when nobody holds it or its holder stopped renewing it, and it is
        not reserved for a job of higher priority that is on its way to take it.
        """
        timeout = self.platform.settings.lease_timeout
        values = {
            "key": key,
            "holder_job": job_id,
            "holder_attempt": attempt,
            "token": token,
            "priority": priority,
            "preemptable": preemptable,
        }
        base = upsert(conn, leases).values(**values, heartbeat_at=db_now())
        ex = base.excluded
        free = and_(
            or_(
                leases.c.holder_job.is_(None),
                leases.c.heartbeat_at < db_now_plus(-timeout),
                leases.c.holder_job == ex.holder_job,
            ),
            or_(
                leases.c.reserved_job.is_(None),
                leases.c.reserved_job == ex.holder_job,
                leases.c.reserved_until < db_now(),
                leases.c.reserved_priority < ex.priority,
            ),
        )
        stmt = base.on_conflict_do_update(
            index_elements=["key"],
            set_={
                "holder_job": ex.holder_job,
                "holder_attempt": ex.holder_attempt,
                "token": ex.token,
                "priority": ex.priority,
                "preemptable": ex.preemptable,
                "heartbeat_at": db_now(),
                "reserved_job": None,
                "reserved_priority": None,
                "reserved_until": None,
            },
            where=free,
        ).returning(leases.c.holder_job)
        if conn.execute(stmt).scalar_one_or_none() == job_id:
            return None
        return conn.execute(select(leases).where(leases.c.key == key)).mappings().one()

    def renew(self, conn: Connection, held: Held, job_id: str) -> bool:
        """Extend the lease; False means it was lost (another holder has it now)."""
        res = conn.execute(
            update(leases)
            .where(leases.c.key == held.key, leases.c.holder_job == job_id, leases.c.token == held.token)
            .values(heartbeat_at=db_now())
        )
        return res.rowcount == 1

    def release(self, held: Held, job_id: str) -> None:
        """Compare-and-release, wake a waiting preemptor, and unpark the best parked job."""
        p = self.platform
        try:
            with p.engine.begin() as conn:
                conn.execute(
                    update(leases)
                    .where(
                        leases.c.key == held.key, leases.c.holder_job == job_id, leases.c.token == held.token
                    )
                    .values(holder_job=None, holder_attempt=None, token=None, heartbeat_at=None)
                )
                unparked = self._unpark_best(conn, held.key)
            pipe = p.redis.pipeline(transaction=False)
            pipe.rpush(self._wake(held.key), job_id)
            pipe.expire(self._wake(held.key), 60)
            pipe.execute()
        except Exception:  # the lease expires on its own; parked jobs are found by the reconciler
            log.warning("could not release lease %s of %s", held.key, job_id, exc_info=True)
            return
        if unparked is not None:
            p.republish_if_queued(unparked)

    def _unpark_best(self, conn: Connection, key: str) -> str | None:
        """Move the highest-priority parked job of ``key`` back to ``queued`` (unless the
        lease is reserved for a preemptor on its way)."""
        lease = conn.execute(select(leases).where(leases.c.key == key)).mappings().one_or_none()
        if lease is not None and lease["holder_job"] is not None:
            return None
        best = (
            conn.execute(
                select(jobs.c.id, jobs.c.priority)
                .where(jobs.c.lease_key == key, jobs.c.status == s.WAITING_LEASE)
                .order_by(jobs.c.priority.desc(), jobs.c.created_at)
                .limit(1)
            )
            .mappings()
            .first()
        )
        if best is None:
            return None
        reserved_for_other = lease is not None and lease["reserved_job"] not in (None, best["id"])
        if reserved_for_other and lease is not None and (lease["reserved_priority"] or 0) > best["priority"]:
            return None
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == best["id"], jobs.c.status == s.WAITING_LEASE)
            .values(status=s.QUEUED, published_at=None, run_at=db_now(), updated_at=db_now())
        )
        if res.rowcount != 1:
            return None
        p = self.platform
        p.store.emit(conn, [new_event(best["id"], "job.unparked", {"lease_key": key})])
        return str(best["id"])

    def unpark_free_keys(self, conn: Connection) -> list[str]:
        """Reconciler: parked jobs whose key is free (a release that found nobody, or a
        holder that died); returns the job ids moved back to ``queued``."""
        keys = (
            conn.execute(
                select(jobs.c.lease_key).where(jobs.c.status == s.WAITING_LEASE).distinct().limit(200)
            )
            .scalars()
            .all()
        )
        out: list[str] = []
        timeout = self.platform.settings.lease_timeout
        for key in keys:
            lease = conn.execute(select(leases).where(leases.c.key == key)).mappings().one_or_none()
            if lease is not None and lease["holder_job"] is not None:
                live = conn.execute(
                    select(leases.c.key).where(
                        leases.c.key == key, leases.c.heartbeat_at >= db_now_plus(-timeout)
                    )
                ).first()
                if live is not None:
                    continue
                conn.execute(update(leases).where(leases.c.key == key).values(holder_job=None, token=None))
            job = self._unpark_best(conn, key)
            if job:
                out.append(job)
        return out

    # -- parking & waiting ----------------------------------------------------------------

    def park(self, ctx: JobContext, key: str, owner: str) -> None:
        """``running → waiting_lease`` without counting the attempt; re-checks afterwards so
        a release that happened meanwhile cannot leave the job parked forever."""
        p = self.platform
        with p.engine.begin() as conn:
            res = conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == ctx.job_id,
                    jobs.c.status == s.RUNNING,
                    jobs.c.attempts == ctx.attempt,
                    jobs.c.lease_owner == owner,
                )
                .values(
                    status=s.WAITING_LEASE,
                    lease_key=key,
                    uncounted=jobs.c.uncounted + 1,
                    published_at=None,
                    lease_owner=None,
                    updated_at=db_now(),
                )
            )
            if res.rowcount == 1:
                p.store.emit(conn, [new_event(ctx.job_id, "job.parked", {"lease_key": key})])
            unparked = self._unpark_best(conn, key)
        if unparked is not None:
            p.republish_if_queued(unparked)

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until the key's wake list gets an entry or ``timeout`` passes."""
        if timeout > 0:
            self.platform.redis.blpop([self._wake(key)], timeout=max(0.01, timeout))

    # -- stop requests --------------------------------------------------------------------

    def request_preemption(
        self, conn: Connection, lease: Mapping[Any, Any], *, by_job: str, priority: int
    ) -> bool:
        """Reserve ``lease`` for ``by_job`` and ask its holder to stop (Postgres flag)."""
        holder = lease["holder_job"]
        if holder is None or not lease["preemptable"] or (lease["priority"] or 0) >= priority:
            return False
        budget = self.platform.settings.preempt_wait_budget
        conn.execute(
            update(leases)
            .where(
                leases.c.key == lease["key"],
                or_(
                    leases.c.reserved_job.is_(None),
                    leases.c.reserved_priority < priority,
                    leases.c.reserved_until < db_now(),
                    leases.c.reserved_job == by_job,
                ),
            )
            .values(reserved_job=by_job, reserved_priority=priority, reserved_until=db_now_plus(budget))
        )
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == holder, jobs.c.status == s.RUNNING, jobs.c.preempt_requested_at.is_(None))
            .values(preempt_requested_at=db_now())
        )
        if res.rowcount == 1:
            self.platform.store.emit(
                conn,
                [new_event(holder, "job.preemption_requested", {"by": by_job, "lease_key": lease["key"]})],
            )
        return True

    def flag(self, job_id: str, attempt: int, kind: str, task_id: str | None) -> None:
        """After commit: the fast flag the holder's checkpoints read, and a revoke of the
        holder's current Celery task id (never a later attempt's: each publish is fresh)."""
        p = self.platform
        try:
            p.redis.set(self._flag(job_id), f"{kind}:{attempt}", ex=86400)
        except Exception:
            log.warning("could not set the fast stop flag of %s; checkpoints fall back to Postgres", job_id)
        if task_id:
            try:
                p.app.control.revoke(task_id)
            except Exception:
                log.warning("revoke of %s failed", task_id, exc_info=True)

    def stop_requested(self, job_id: str, attempt: int) -> str | None:
        """``"preempt"``/``"cancel"`` when this job and attempt were asked to stop."""
        try:
            raw = self.platform.redis.get(self._flag(job_id))
        except Exception:
            raw = None
        if raw is not None:
            kind, _, at = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(":")
            return kind if at == str(attempt) else None
        return None

    def stop_requested_db(self, job_id: str, attempt: int) -> str | None:
        """The same question asked of Postgres (the truth, e.g. after a Redis wipe)."""
        with reading(self.platform.engine) as conn:
            row = conn.execute(
                select(jobs.c.cancel_requested_at, jobs.c.preempt_requested_at).where(
                    jobs.c.id == job_id, jobs.c.attempts == attempt, jobs.c.status == s.RUNNING
                )
            ).first()
        if row is None:
            return None
        if row.cancel_requested_at is not None:
            return CANCEL
        return PREEMPT if row.preempt_requested_at is not None else None

    def clear_flag(self, job_id: str) -> None:
        """Forget a stop flag once it was acted on."""
        with contextlib.suppress(Exception):
            self.platform.redis.delete(self._flag(job_id))

    def next_token(self, conn: Connection) -> int:
        """A fresh fencing token."""
        return next_seq(conn)


def format_key(template: str, payload: Mapping[str, Any]) -> str:
    """``"user:{user_id}"`` filled from the payload."""
    return template.format(**payload)[:200]
