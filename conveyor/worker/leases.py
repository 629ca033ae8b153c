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

The requests and the stop flags themselves are :mod:`conveyor.client.stops` (a caller's
``cancel()`` and a submit's preemption raise them too); this module is the holder's side.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore
from sqlalchemy import Connection, and_, or_, select, update
from sqlalchemy.engine import RowMapping

from conveyor.client.recorder import Recorder
from conveyor.client.stops import PREEMPT, Stops
from conveyor.delivery.connections import Connections
from conveyor.runfile import lease_owner
from conveyor.stage import StageSpec, format_key
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus, next_seq, upsert
from conveyor.store.db.schema import jobs, leases
from conveyor.store.jobs import JobStore, new_event

log = logging.getLogger("conveyor.leases")


@dataclass(frozen=True)
class Held:
    """A lease this attempt holds."""

    key: str
    token: int


class Leases:
    """Lease table operations: take, renew, release, park and unpark."""

    def __init__(
        self, connections: Connections, *, store: JobStore, recorder: Recorder, stops: Stops
    ) -> None:
        self.connections = connections
        self.store = store
        self.recorder = recorder
        self.stops = stops

    def _wake(self, key: str) -> str:
        return f"{self.connections.settings.key_prefix}wake:{key}"

    # -- taking -------------------------------------------------------------------------

    def take(self, job_id: str, attempt: int, spec: StageSpec, payload: Any) -> Held:
        """Hold the stage's lease key, preempting a lower-priority holder if allowed.

        A job that cannot have the lease is parked (``waiting_lease``: no pool slot) and the
        message is acked; only a preemptor with a request in flight waits here, woken by the
        release, for at most the wait budget. Returns the lease held.
        """
        assert spec.lease_key is not None
        key = format_key(spec.lease_key, payload.model_dump(mode="json"))
        owner = lease_owner()
        deadline = time.monotonic() + self.connections.settings.preempt_wait_budget
        token = None
        while True:
            requested: tuple[str, int, str | None] | None = None
            with self.connections.engine.begin() as conn:
                token = token or self.next_token(conn)
                lease = self.try_acquire(
                    conn,
                    key=key,
                    job_id=job_id,
                    attempt=attempt,
                    priority=spec.priority,
                    preemptable=spec.preemptable,
                    token=token,
                )
                if lease is None:
                    conn.execute(update(jobs).where(jobs.c.id == job_id).values(lease_key=key))
                    return Held(key, token)
                preempting = self.stops.request_preemption(conn, lease, by_job=job_id, priority=spec.priority)
                if preempting and lease["holder_job"]:
                    holder = self.store.get(conn, lease["holder_job"])
                    if holder is not None and holder["status"] == s.RUNNING:
                        requested = (holder["id"], int(holder["attempts"]), holder["celery_task_id"])
            if requested is not None:
                self.stops.flag(requested[0], requested[1], PREEMPT, requested[2])
            left = deadline - time.monotonic()
            if not preempting or left <= 0:
                self.park(job_id, attempt, key, owner)
                raise Ignore()
            self.wait_for_release(key, min(left, 1.0))

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
        timeout = self.connections.settings.lease_timeout
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
        try:
            with self.connections.engine.begin() as conn:
                conn.execute(
                    update(leases)
                    .where(
                        leases.c.key == held.key, leases.c.holder_job == job_id, leases.c.token == held.token
                    )
                    .values(holder_job=None, holder_attempt=None, token=None, heartbeat_at=None)
                )
                unparked = self._unpark_best(conn, held.key)
            pipe = self.connections.redis.pipeline(transaction=False)
            pipe.rpush(self._wake(held.key), job_id)
            pipe.expire(self._wake(held.key), 60)
            pipe.execute()
        except Exception:  # the lease expires on its own; parked jobs are found by the reconciler
            log.warning("could not release lease %s of %s", held.key, job_id, exc_info=True)
            return
        if unparked is not None:
            self.recorder.republish_if_queued(unparked)

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
        self.store.emit(conn, [new_event(best["id"], "job.unparked", {"lease_key": key})])
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
        timeout = self.connections.settings.lease_timeout
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

    def park(self, job_id: str, attempt: int, key: str, owner: str) -> None:
        """``running → waiting_lease`` without counting the attempt; re-checks afterwards so
        a release that happened meanwhile cannot leave the job parked forever."""
        with self.connections.engine.begin() as conn:
            res = conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id,
                    jobs.c.status == s.RUNNING,
                    jobs.c.attempts == attempt,
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
                self.store.emit(conn, [new_event(job_id, "job.parked", {"lease_key": key})])
            unparked = self._unpark_best(conn, key)
        if unparked is not None:
            self.recorder.republish_if_queued(unparked)

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until the key's wake list gets an entry or ``timeout`` passes."""
        if timeout > 0:
            self.connections.redis.blpop([self._wake(key)], timeout=max(0.01, timeout))

    def next_token(self, conn: Connection) -> int:
        """A fresh fencing token."""
        return next_seq(conn)


__all__ = ["Held", "Leases"]
