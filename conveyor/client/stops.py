"""Asking a job to stop: cancellation and preemption requests, and the flags they raise.

A request is written to Postgres (``cancel_requested_at``, ``preempt_requested_at``: the
truth) and, after commit, to a fast flag in Redis that the running job's checkpoints and
heartbeat read, plus a revoke of its current Celery task id. The running side of a stop
(checkpoints, the interrupt signal, the lease hand-over) is the worker's: see
:mod:`conveyor.worker.leases` and :mod:`conveyor.worker.heartbeat`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from celery import states
from celery.app.task import Context
from celery.exceptions import TaskRevokedError
from sqlalchemy import Connection, or_, select, update

from conveyor.client.followers import Settles
from conveyor.delivery.connections import Connections
from conveyor.stage import StageSpec, format_key
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import jobs, leases
from conveyor.store.jobs import JobStore, new_event

log = logging.getLogger("conveyor.stops")

PREEMPT = "preempt"
CANCEL = "cancel"


class Stops:
    """Cancel and preemption requests, and the stop flags running jobs read."""

    def __init__(self, connections: Connections, *, store: JobStore, settle: Settles) -> None:
        self.connections = connections
        self.store = store
        self.settle = settle

    def _flag(self, job_id: str) -> str:
        return f"{self.connections.settings.key_prefix}stop:{job_id}"

    # -- requests -------------------------------------------------------------------------

    def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in (idempotent).

        A queued, delayed or parked job ends ``cancelled`` at once (a message already on
        the broker finds it cancelled at claim, even if every worker was offline when
        this ran). A running job is asked to stop: it raises ``Cancelled`` at its next
        checkpoint, or is interrupted after its grace period. A job that already finished
        keeps its final state, which is returned.
        """
        stop: tuple[int, str | None] | None = None
        with self.connections.engine.begin() as conn:
            # Locked: a claim or requeue committing between our read and write would make the
            # compare-and-set miss and the cancel vanish.
            row = (
                conn.execute(select(jobs).where(jobs.c.id == job_id).with_for_update())
                .mappings()
                .one_or_none()
            )
            if row is None:
                raise LookupError(f"job {job_id} not found")
            status = str(row["status"])
            who = {"cancelled_by": by[:200], "cancel_reason": reason}
            if status in (*s.CLAIMABLE, s.WAITING_LEASE, s.WAITING_DEDUP):
                ok = self.store.finish(
                    conn,
                    row,
                    s.CANCELLED,
                    from_status=(status,),
                    topic="job.cancelled",
                    body={"by": by, "reason": reason, "while": status},
                )
                if ok:
                    conn.execute(
                        update(jobs).where(jobs.c.id == job_id).values(cancel_requested_at=db_now(), **who)
                    )
                    status = s.CANCELLED
                else:
                    status = str(self.store.get(conn, job_id)["status"])  # type: ignore[index]
            elif status == s.RUNNING:
                res = conn.execute(
                    update(jobs)
                    .where(
                        jobs.c.id == job_id, jobs.c.status == s.RUNNING, jobs.c.cancel_requested_at.is_(None)
                    )
                    .values(cancel_requested_at=db_now(), **who)
                )
                if res.rowcount == 1:
                    self.store.emit(
                        conn, [new_event(job_id, "job.cancel_requested", {"by": by, "reason": reason})]
                    )
                stop = (int(row["attempts"]), row["celery_task_id"])
        if stop is not None:
            self.flag(job_id, stop[0], CANCEL, stop[1], fast=True)
        elif status == s.CANCELLED:
            self.settle.finished(job_id, status, dedup_key=row["dedup_key"])
        return status

    def request_preemption(
        self, conn: Connection, lease: Mapping[Any, Any], *, by_job: str, priority: int
    ) -> bool:
        """Reserve ``lease`` for ``by_job`` and ask its holder to stop (Postgres flag)."""
        holder = lease["holder_job"]
        if holder is None or not lease["preemptable"] or (lease["priority"] or 0) >= priority:
            return False
        budget = self.connections.settings.preempt_wait_budget
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
            self.store.emit(
                conn,
                [new_event(holder, "job.preemption_requested", {"by": by_job, "lease_key": lease["key"]})],
            )
        return True

    def preempt_holder(self, job_id: str, spec: StageSpec, payload: Mapping[str, Any]) -> None:
        """Submit-time preemption: ask a lower-priority preemptable holder of the lease to
        yield now, so it stops even if no pool slot is free for the new job."""
        assert spec.lease_key is not None
        key = format_key(spec.lease_key, payload)
        flag: tuple[str, int, str | None] | None = None
        with self.connections.engine.begin() as conn:
            lease = conn.execute(select(leases).where(leases.c.key == key)).mappings().one_or_none()
            if lease is None or lease["holder_job"] in (None, job_id):
                return
            if self.request_preemption(conn, lease, by_job=job_id, priority=spec.priority):
                holder = self.store.get(conn, lease["holder_job"])
                if holder is not None and holder["status"] == s.RUNNING:
                    flag = (str(holder["id"]), int(holder["attempts"]), holder["celery_task_id"])
        if flag is not None:
            self.flag(flag[0], flag[1], PREEMPT, flag[2])

    # -- flags ----------------------------------------------------------------------------

    def flag(self, job_id: str, attempt: int, kind: str, task_id: str | None, *, fast: bool = False) -> None:
        """After commit: the fast flag the holder's checkpoints read, and a revoke of the
        holder's current Celery task id (never a later attempt's: each publish is fresh).

        With ``fast`` (a caller's cancel) Redis gets one short try and no revoke while it
        does not answer: the request is in Postgres, which the holder's heartbeat reads."""
        connections = self.connections
        key, value = self._flag(job_id), f"{kind}:{attempt}"
        if fast:
            if connections.fast.attempt(lambda r: r.set(key, value, ex=86400)) is None:
                log.info("stop flag of %s left to Postgres: Redis does not answer", job_id)
                return
        else:
            try:
                connections.redis.set(key, value, ex=86400)
            except Exception:
                log.warning(
                    "could not set the fast stop flag of %s; checkpoints fall back to Postgres", job_id
                )
        if task_id:
            try:
                connections.app.control.revoke(task_id)
            except Exception:
                log.warning("revoke of %s failed", task_id, exc_info=True)

    def stop_requested(self, job_id: str, attempt: int) -> str | None:
        """``"preempt"``/``"cancel"`` when this job and attempt were asked to stop."""
        try:
            raw = self.connections.redis.get(self._flag(job_id))
        except Exception:
            raw = None
        if raw is not None:
            kind, _, at = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(":")
            return kind if at == str(attempt) else None
        return None

    def stop_requested_db(self, job_id: str, attempt: int) -> str | None:
        """The same question asked of Postgres (the truth, e.g. after a Redis wipe)."""
        with reading(self.connections.engine) as conn:
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
            self.connections.redis.delete(self._flag(job_id))


def report_revoked(connections: Connections, job_id: str) -> None:
    """After a job ended ``cancelled`` or ``expired`` (it never produced a result), tell
    Celery's result backend what Celery records for a revoked task: state ``REVOKED`` with
    :class:`~celery.exceptions.TaskRevokedError` under its task id (and the rest of its
    chain), and its part of its chord, however the job ended so (queued, running, or
    following a dedup holder, which never ran and no worker counts). A caller's
    ``AsyncResult.get()`` raises instead of waiting, and the chord's counter is full, so its
    body fails with ``ChordError``. Idempotent: Celery counts a task id in a chord once.
    A job of ``submit()`` has no Celery caller: nothing is written."""
    try:
        with reading(connections.engine) as conn:
            row: s.Row | None = conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().one_or_none()
        if row is None or row["status"] not in (s.CANCELLED, s.EXPIRED) or not s.wants_celery_result(row):
            return
        options = row["options"] or {}
        task_id = row["origin_task_id"] or row["id"]
        member = bool(options.get("chord")) and not options.get("chain")
        request = Context(
            # A chord counts a member under its delivery's id, as Flow.count_in_chord does.
            id=row["celery_task_id"] or task_id,
            chain=options.get("chain"),
            chord=options.get("chord") if member else None,
            group=options.get("group_id"),
            group_index=options.get("group_index"),
            root_id=options.get("root_id"),
        )
        connections.app.backend.mark_as_failure(
            task_id,
            TaskRevokedError(str(row["status"])),
            request=request,
            call_errbacks=False,
            state=states.REVOKED,
        )
    except Exception:  # the job's own state is in Postgres; only a Celery caller waits on this
        log.warning("could not report job %s as revoked to the result backend", job_id, exc_info=True)


__all__ = ["CANCEL", "PREEMPT", "Stops", "report_revoked"]
