"""The reconciler: repairs what was lost, in the relay's pass.

A job whose lease went stale is requeued (or buried once its budget is spent); an overdue
job expires; a stop request no checkpoint honoured is escalated to an interrupt; parked
jobs whose lease key is free are unparked; followers of ended holders are settled; rows
past retention are purged. See :mod:`conveyor.upkeep.relay` for the pass that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, exists, func, or_, select, tuple_, update

from conveyor.client.followers import Followers
from conveyor.client.recorder import Recorder
from conveyor.delivery.connections import Connections
from conveyor.errors import WorkerLost
from conveyor.metrics import Metrics
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.schema import dead_letters, dedup_keys, job_events, jobs
from conveyor.store.jobs import JobStore, counted_attempts, new_event
from conveyor.store.liveness import takeovers_allowed
from conveyor.worker.flow import Burial, Flow
from conveyor.worker.leases import Leases

BATCH = 500  # rows per query of one pass
# Rows of each table the retention purge deletes per pass: a pass every 2 s keeps up with
# 5,000 finished jobs a second, and one pass after a week's outage stays short.
PURGE_ROWS = 10_000


@dataclass
class TickReport:
    """What one relay/reconciler pass did (for logs and tests)."""

    published: int = 0
    republished: int = 0
    stalled: int = 0
    dead: int = 0
    expired: int = 0
    purged: int = 0
    retried: int = 0  # dead letters whose requested retry a worker performed
    skipped_lock: bool = False
    skipped_busy: bool = False  # SQLite's writer was held by a long transaction
    next_due: float | None = None  # seconds until the next unpublished job falls due


class Reconciler:
    """Requeues stalled jobs, expires overdue ones, escalates stop requests, purges."""

    def __init__(
        self,
        connections: Connections,
        *,
        stages: Stages,
        store: JobStore,
        recorder: Recorder,
        flow: Flow,
        leases: Leases,
        followers: Followers,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.stages = stages
        self.store = store
        self.recorder = recorder
        self.flow = flow
        self.leases = leases
        self.followers = followers
        self.metrics = metrics
        self._unparked: list[str] = []
        self._interrupts: list[tuple[str, int, str]] = []
        self._burials: list[Burial] = []
        self._stuck: list[str] = []  # holders whose followers wait although they ended
        self._keys_after: tuple[str, str] | None = None  # where the dedup-key sweep resumes

    def begin(self) -> None:
        """A new pass: forget the burials of a pass that failed before committing them."""
        self._burials = []

    def reconcile(
        self, conn: Any, report: TickReport, *, redis_up: bool = True
    ) -> list[tuple[str, str, str | None]]:
        """Requeue stalled jobs, expire overdue ones, purge; returns the jobs it finished.

        With Redis down it does only what needs no Redis after commit: burials (a chord's
        counter lives in Redis), unparking and escalations wait for the next pass.
        """
        settings = self.connections.settings
        finished: list[tuple[str, str, str | None]] = []
        store = self.store
        stale = (
            conn.execute(
                select(jobs)
                .where(
                    jobs.c.status == s.RUNNING,
                    jobs.c.heartbeat_at < db_now_plus(-settings.lease_timeout),
                    takeovers_allowed(settings.lease_timeout),
                )
                .limit(BATCH)
            )
            .mappings()
            .all()
        )
        for row in stale:
            attempt = int(row["attempts"])
            body = {"while": "stalled", "previous_owner": row["lease_owner"]}
            stopped = store.end_if_stopped(conn, row, body=body)
            if stopped is not None:
                if stopped[1]:
                    finished.append((str(row["id"]), stopped[0], row["dedup_key"]))
                continue
            if counted_attempts(row) >= int(row["max_attempts"]):
                if not redis_up:
                    continue
                message = (
                    f"attempt {counted_attempts(row)} of {row['max_attempts']} stopped heartbeating "
                    "(worker crash, kill or hang); giving up"
                )
                burial = self.flow.bury(
                    conn, row, error=WorkerLost(message), message=message, attempt=attempt
                )
                if burial is not None:
                    report.dead += 1
                    self._burials.append(burial)
                continue
            res = conn.execute(
                update(jobs)
                .where(jobs.c.id == row["id"], jobs.c.status == s.RUNNING, jobs.c.attempts == attempt)
                .values(
                    status=s.QUEUED,
                    published_at=None,
                    lease_owner=None,
                    run_at=db_now(),
                    error_type="WorkerLost",
                    last_error="lease expired",
                    updated_at=db_now(),
                )
            )
            if res.rowcount == 1:
                store.emit(
                    conn,
                    [
                        new_event(
                            row["id"],
                            "job.stalled",
                            {"stage": row["stage"], "attempt": attempt, "previous_owner": row["lease_owner"]},
                        )
                    ],
                )
                self.metrics.inc("stalled", row["stage"])
                report.stalled += 1
                self.flow.record_stalled(conn, row, attempt)
        expired = (
            conn.execute(
                select(jobs)
                .where(
                    jobs.c.status.in_(s.CLAIMABLE),
                    jobs.c.expires_at.is_not(None),
                    jobs.c.expires_at <= db_now(),
                )
                .limit(BATCH)
            )
            .mappings()
            .all()
        )
        for row in expired:
            if store.finish(conn, row, s.EXPIRED, from_status=s.CLAIMABLE, topic="job.expired"):
                self.metrics.inc("expired", row["stage"])
                report.expired += 1
                finished.append((row["id"], s.EXPIRED, row["dedup_key"]))
        report.purged += self._purge(conn)
        if redis_up:
            self._unparked = self.leases.unpark_free_keys(conn)
            self._interrupts = self._escalations(conn)
            self._stuck = self.followers.stuck_holders(conn)
        return finished

    def _escalations(self, conn: Any) -> list[tuple[str, int, str]]:
        """Running jobs asked to stop (preempt or cancel) that let their grace period pass
        without a checkpoint; each is escalated once."""
        grace = self.connections.settings.preempt_grace
        cutoff = db_now_plus(-grace)
        rows = conn.execute(
            select(jobs.c.id, jobs.c.attempts, jobs.c.celery_task_id, jobs.c.stage)
            .where(
                jobs.c.status == s.RUNNING,
                jobs.c.interrupt_sent_at.is_(None),
                or_(jobs.c.preempt_requested_at < cutoff, jobs.c.cancel_requested_at < cutoff),
            )
            .limit(50)
        ).all()
        out = []
        for row in rows:
            spec = self.stages.get(row.stage)
            if spec is not None and spec.grace is not None and spec.grace > grace:
                waited_enough = conn.execute(
                    select(jobs.c.id).where(
                        jobs.c.id == row.id,
                        or_(
                            jobs.c.preempt_requested_at < db_now_plus(-spec.grace),
                            jobs.c.cancel_requested_at < db_now_plus(-spec.grace),
                        ),
                    )
                ).first()
                if waited_enough is None:
                    continue
            res = conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == row.id, jobs.c.attempts == row.attempts, jobs.c.interrupt_sent_at.is_(None)
                )
                .values(interrupt_sent_at=db_now())
            )
            if res.rowcount == 1 and row.celery_task_id:
                store_event = new_event(row.id, "job.interrupt_sent", {"attempt": row.attempts})
                self.store.emit(conn, [store_event])
                out.append((str(row.id), int(row.attempts), str(row.celery_task_id)))
        return out

    def _purge(self, conn: Any) -> int:
        """Delete what is past retention, at most ``PURGE_ROWS`` rows of each table a pass
        (the rest next pass), so the pass's transaction stays short after a long outage."""
        settings = self.connections.settings
        keep = -settings.retention_days * 86400
        finished = jobs.c.status.in_(list(s.TERMINAL))
        n = _purge_some(conn, jobs, jobs.c.finished_at, finished, jobs.c.finished_at < db_now_plus(keep))
        n += _purge_some(
            conn, job_events, job_events.c.created_at, job_events.c.created_at < db_now_plus(keep)
        )
        n += self._purge_orphan_keys(conn)
        n += self.followers.purge(conn)
        dlq_keep = -settings.dlq_retention_days * 86400
        old_letters = dead_letters.c.created_at < db_now_plus(dlq_keep)
        n += _purge_some(conn, dead_letters, dead_letters.c.created_at, old_letters)
        return n

    def _purge_orphan_keys(self, conn: Any) -> int:
        """Delete dedup keys whose holder is gone (purged, or never committed), sweeping
        ``BATCH`` keys per pass in key order and resuming there next pass.

        One window at a time keeps the holder check to index probes of ``jobs``: the whole
        table anti-joined with ``jobs`` made the planner hash every job on every pass
        (issue #16, ``tests/integration/test_hot_path_plans.py``)."""
        key = tuple_(dedup_keys.c.scope, dedup_keys.c.key)
        window = select(dedup_keys.c.scope, dedup_keys.c.key).order_by(dedup_keys.c.scope, dedup_keys.c.key)
        if self._keys_after is not None:
            window = window.where(key > tuple_(*self._keys_after))
        rows = conn.execute(window.limit(BATCH)).all()
        self._keys_after = (str(rows[-1][0]), str(rows[-1][1])) if len(rows) == BATCH else None
        if not rows:
            return 0
        holder_gone = ~exists(select(jobs.c.id).where(jobs.c.id == dedup_keys.c.job_id))
        swept = key.in_([(str(r[0]), str(r[1])) for r in rows])
        return int(conn.execute(delete(dedup_keys).where(swept, holder_gone)).rowcount or 0)

    def after_commit(self) -> None:
        """After the pass committed (with Redis up): carry on the burials' flows, publish
        the unparked jobs, settle stuck followers, send the escalations."""
        for burial in self._burials:
            self.flow.after_burial(burial)
        for job_id in self._unparked:
            self.recorder.republish_if_queued(job_id)
        for holder in self._stuck:
            self.flow.resolve(holder)
        for job_id, attempt, task_id in self._interrupts:
            self.connections.app.control.broadcast(
                "conveyor_interrupt", arguments={"job_id": job_id, "attempt": attempt, "task_id": task_id}
            )
        self._unparked, self._interrupts, self._burials, self._stuck = [], [], [], []


def _purge_some(conn: Any, table: Any, oldest: Any, *where: Any) -> int:
    """Delete up to ``PURGE_ROWS`` rows of ``table`` matching ``where``, ``oldest`` first:
    found through the index of ``oldest``, deleted through the primary key."""
    doomed = select(table.c.id).where(*where).order_by(oldest).limit(PURGE_ROWS)
    if conn.dialect.name == "postgresql":
        # With ``IN (subquery)`` the planner hash-joins a scan of the whole table instead.
        target = table.c.id == func.any(func.array(doomed.scalar_subquery()))
    else:
        target = table.c.id.in_(doomed)
    return int(conn.execute(delete(table).where(target)).rowcount or 0)


__all__ = ["Reconciler", "TickReport"]
