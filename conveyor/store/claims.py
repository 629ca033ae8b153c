"""Claiming a delivered job: the compare-and-set that starts an attempt, and its siblings.

A claim wins from ``queued``/``retrying``/``throttled`` when the job is due, unexpired and
not cancelled, or takes over from ``running`` when the owner is known dead: a process of
this node (host, boot and PID namespace) that is gone, or a lease that went stale while
the database was reachable (:mod:`conveyor.store.liveness`). Every attempt starts by checking
the job's cancel request and expiry, and with no stop request of the attempt before it.
``attempts`` is the fencing token and grows on every claim; ``uncounted`` counts the
claims that did not count.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sqlalchemy import Connection, and_, insert, or_, select, update
from sqlalchemy.engine import RowMapping

from conveyor.retry import requeue_delay
from conveyor.runfile import local_pid, pid_alive
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus, is_sqlite, pg_statements
from conveyor.store.db.schema import Row, job_events, jobs, new_event
from conveyor.store.liveness import takeovers_allowed


class ClaimOutcome(Enum):
    """What a delivered message should do after trying to claim its job."""

    RUN = "run"
    LIVE_LEASE = "live_lease"  # another copy holds a live lease: skip
    ALREADY_SUCCEEDED = "already_succeeded"  # do not run; still dispatch the continuation
    TERMINAL = "terminal"  # dead, cancelled, expired, skipped: nothing to do
    NOT_DUE = "not_due"  # an early copy of a delayed/backing-off job: the relay owns it
    MISSING = "missing"
    WORKER_LOST = "worker_lost"  # its last attempt's worker died: dead-letter it (the caller)
    REQUEUES_EXHAUSTED = "requeues_exhausted"  # infrastructure kept failing: dead-letter it


@dataclass(frozen=True)
class Claim:
    """The result of :meth:`JobStore.claim`."""

    outcome: ClaimOutcome
    job: Row | None = None
    took_over: bool = False


def counted_attempts(row: Row) -> int:
    """Attempts that count against ``max_attempts``: claims minus uncounted ones."""
    return int(row["attempts"]) - int(row["uncounted"] or 0)


class Claims:
    """The claim half of :class:`~conveyor.store.jobs.JobStore`, and the row primitives
    (``get``, ``emit``, ``finish``) both halves use."""

    lease_timeout: float
    max_requeues: int
    detect_local_dead_owners: bool
    # An outage's uncounted requeue waits requeue_delay(requeues) (settings infra_backoff/_cap).
    requeue_backoff: float
    requeue_backoff_cap: float
    # Called in the transaction that expires a job, with its row (the stage's on_expired:
    # conveyor.worker.flow.Flow.record_expired, set by the platform).
    expired_hook: Callable[[Connection, Row], None] | None = None

    # -- the row primitives both halves of the store use ---------------------------------

    def get(self, conn: Connection, job_id: str) -> RowMapping | None:
        """One job row, or None."""
        return conn.execute(select(jobs).where(jobs.c.id == job_id)).mappings().one_or_none()

    def emit(self, conn: Connection, events: Sequence[Mapping[str, Any]]) -> None:
        """Append events to the outbox inside ``conn``'s transaction."""
        if not events:
            return
        conn.execute(insert(job_events).values(created_at=db_now()), [dict(e) for e in events])

    def finish(
        self,
        conn: Connection,
        job: Row,
        status: str,
        *,
        from_status: Iterable[str],
        topic: str,
        attempt: int | None = None,
        body: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> bool:
        """CAS ``from_status → status`` (a terminal one) and emit ``topic``."""
        cond = [jobs.c.id == job["id"], jobs.c.status.in_(list(from_status))]
        cond.append(jobs.c.attempts == (job["attempts"] if attempt is None else attempt))
        values: dict[str, Any] = {
            "status": status,
            "lease_owner": None,
            "finished_at": db_now(),
            "updated_at": db_now(),
        }
        if error is not None:
            values["last_error"] = error
        ok = conn.execute(update(jobs).where(*cond).values(**values)).rowcount == 1
        if ok:
            self.emit(conn, [new_event(job["id"], topic, {"stage": job["stage"], **(body or {})})])
            if status == s.EXPIRED and self.expired_hook is not None:
                self.expired_hook(conn, job)
        return ok

    def throttle(
        self,
        conn: Connection,
        job_id: str,
        *,
        wait: float,
        body: Mapping[str, Any],
        topic: str = "job.rate_limited",
        until: dt.datetime | None = None,
    ) -> bool:
        """Park a due, claimable job as ``throttled`` until ``run_at = until`` (else now +
        ``wait``), with a ``topic`` event. False if the job is not waiting to be claimed (the
        delivery goes on to its claim, which says why)."""
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status.in_(s.CLAIMABLE), jobs.c.run_at <= db_now())
            .values(
                status=s.THROTTLED,
                run_at=until if until is not None else db_now_plus(wait),
                published_at=None,
                updated_at=db_now(),
            )
        )
        if res.rowcount != 1:
            return False
        self.emit(conn, [new_event(job_id, topic, {**body, "wait": round(wait, 3)})])
        return True

    def unthrottle(self, conn: Connection, job_id: str, *, topic: str, body: Mapping[str, Any]) -> bool:
        """A ``throttled`` job due now (a slot it waits for freed): ``queued``, unpublished."""
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == s.THROTTLED)
            .values(status=s.QUEUED, run_at=db_now(), published_at=None, updated_at=db_now())
        )
        if res.rowcount != 1:
            return False
        self.emit(conn, [new_event(job_id, topic, body)])
        return True

    # -- claims ---------------------------------------------------------------------------

    def claim(self, conn: Connection, job_id: str, *, owner: str, task_id: str) -> Claim:
        """Move ``job_id`` to ``running`` for this delivery, or say why not.

        Wins from ``queued``/``retrying`` when due, unexpired and not cancelled, or from
        ``running`` when the lease is stale (a takeover: attempt n+1). Losers lose by
        rowcount, never by exception.
        """
        if is_sqlite(conn):
            due = and_(
                jobs.c.status.in_(s.CLAIMABLE),
                jobs.c.run_at <= db_now(),
                jobs.c.cancel_requested_at.is_(None),
                or_(jobs.c.expires_at.is_(None), jobs.c.expires_at > db_now()),
            )
            row = self._take(conn, job_id, due, owner=owner, task_id=task_id)
        else:
            params = {"id": job_id, "owner": owner, "task_id": task_id}
            row = conn.execute(pg_statements(conn).claim, params).mappings().first()
        if row is not None:
            return Claim(ClaimOutcome.RUN, row)
        current = self.get(conn, job_id)
        if current is None:
            return Claim(ClaimOutcome.MISSING)
        status = current["status"]
        if status == s.SUCCEEDED:
            return Claim(ClaimOutcome.ALREADY_SUCCEEDED, current)
        if status in s.TERMINAL:
            return Claim(ClaimOutcome.TERMINAL, current)
        if status == s.RUNNING:
            mine = current["lease_owner"] == owner
            if not mine and not self._owner_gone(conn, current):
                return Claim(ClaimOutcome.LIVE_LEASE, current)
            body = {"while": "takeover", "previous_owner": current["lease_owner"]}
            stopped = self.end_if_stopped(conn, current, body=body)
            if stopped is not None:
                outcome = ClaimOutcome.TERMINAL if stopped[1] else ClaimOutcome.LIVE_LEASE
                return Claim(outcome, self.get(conn, job_id))
            if mine:
                return self._retake_own(conn, current, owner=owner, task_id=task_id)
            return self._takeover_dead(conn, current, owner=owner, task_id=task_id)
        # queued or retrying, but the claim lost: cancelled, expired, or not yet due.
        if self.end_if_stopped(conn, current) is not None:
            return Claim(ClaimOutcome.TERMINAL, self.get(conn, job_id))
        return Claim(ClaimOutcome.NOT_DUE, current)

    def _owner_gone(self, conn: Connection, current: RowMapping) -> bool:
        """The running attempt's owner is known dead (a process of this node that no longer
        exists) or its lease went stale while the database was reachable."""
        if self.detect_local_dead_owners and _owner_dead(current["lease_owner"]):
            return True
        return self._is_stale(conn, current["id"])

    def end_if_stopped(
        self, conn: Connection, row: Row, *, body: Mapping[str, Any] | None = None
    ) -> tuple[str, bool] | None:
        """Every attempt starts by checking the job's cancel request and expiry, whatever
        led to it (a first claim, a takeover, the reconciler's requeue): a job cancelled
        or expired meanwhile ends so, from the status ``row`` shows. Returns the terminal
        status and whether this compare-and-set ended it; None when neither applies."""
        if row["cancel_requested_at"] is not None:
            status, topic = s.CANCELLED, "job.cancelled"
        elif row["expires_at"] is not None and self._expired(conn, row["id"]):
            status, topic = s.EXPIRED, "job.expired"
        else:
            return None
        ended = self.finish(conn, row, status, from_status=(row["status"],), topic=topic, body=body)
        return status, ended

    def _retake_own(self, conn: Connection, current: RowMapping, *, owner: str, task_id: str) -> Claim:
        """This very process held the lease and is idle: its attempt was cut short by an
        infrastructure error, and the message came back before the release the outage
        deferred. Release it now as that would have: uncounted, bounded by
        ``max_requeues``, due after the requeue back-off (the relay publishes it then), so
        no path reruns an outage's attempt sooner."""
        job_id = current["id"]
        outcome = self.release_uncounted(conn, job_id, int(current["attempts"]), owner, "infrastructure")
        if outcome == "exhausted":
            return Claim(ClaimOutcome.REQUEUES_EXHAUSTED, current)
        done = ClaimOutcome.NOT_DUE if outcome == "released" else ClaimOutcome.LIVE_LEASE
        return Claim(done, self.get(conn, job_id))

    def release_uncounted(
        self,
        conn: Connection,
        job_id: str,
        attempt: int | None,
        owner: str,
        reason: str,
        *,
        topic: str = "job.requeued",
        requeue: bool = True,
    ) -> str:
        """CAS ``running → queued`` for an attempt that must not count: stopped by an
        outage or a shutdown (``requeue``: bounded by ``max_requeues``) or preempted. The
        relay republishes it: at once, or for an outage (``reason`` "infrastructure") after
        :func:`~conveyor.retry.requeue_delay` of the job's requeues so far. ``attempt`` None
        matches the owner's current attempt (the worker's main process does not know it).

        Returns ``"released"``, ``"exhausted"`` (the requeue bound is reached: the caller
        dead-letters the job) or ``"refused"`` (the attempt no longer owns the job).
        """
        cond = [jobs.c.id == job_id, jobs.c.status == s.RUNNING, jobs.c.lease_owner == owner]
        if attempt is not None:
            cond.append(jobs.c.attempts == attempt)
        current = conn.execute(select(jobs.c.attempts, jobs.c.requeues).where(*cond)).first()
        if current is None:
            return "refused"
        if requeue and int(current.requeues) >= self.max_requeues:
            return "exhausted"
        values: dict[str, Any] = {"uncounted": jobs.c.uncounted + 1}
        if requeue:
            values["requeues"] = jobs.c.requeues + 1
        delay = 0.0
        if requeue and reason == "infrastructure":
            delay = requeue_delay(
                int(current.requeues), base=self.requeue_backoff, cap=self.requeue_backoff_cap
            )
        res = conn.execute(
            update(jobs)
            .where(*cond, jobs.c.attempts == current.attempts)
            .values(
                status=s.QUEUED,
                published_at=None,
                lease_owner=None,
                run_at=db_now_plus(delay) if delay > 0 else db_now(),
                updated_at=db_now(),
                preempt_requested_at=None,
                interrupt_sent_at=None,
                **values,
            )
        )
        if res.rowcount != 1:
            return "refused"
        body: dict[str, Any] = {"reason": reason, "attempt": int(current.attempts)}
        if requeue and reason == "infrastructure":
            body["delay"] = delay
        self.emit(conn, [new_event(job_id, topic, body)])
        return "released"

    def defer(
        self, conn: Connection, job_id: str, attempt: int, owner: str, *, seconds: float, reason: str
    ) -> bool:
        """CAS ``running → throttled`` until database now + ``seconds`` for an attempt that
        raised :class:`~conveyor.errors.Deferred`: uncounted (not a requeue), lease owner
        cleared, a ``job.deferred`` event. False if the attempt no longer owns the job."""
        res = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.status == s.RUNNING,
                jobs.c.lease_owner == owner,
                jobs.c.attempts == attempt,
            )
            .values(
                status=s.THROTTLED,
                run_at=db_now_plus(seconds),
                published_at=None,
                lease_owner=None,
                uncounted=jobs.c.uncounted + 1,
                updated_at=db_now(),
                preempt_requested_at=None,
                interrupt_sent_at=None,
            )
        )
        if res.rowcount != 1:
            return False
        body = {"seconds": round(seconds, 3), "reason": reason[:500], "attempt": attempt}
        self.emit(conn, [new_event(job_id, "job.deferred", body)])
        return True

    def deferred_so_far(self, conn: Connection, job_id: str) -> float:
        """Seconds ``job_id`` has been deferred in all (its ``job.deferred`` events)."""
        rows = conn.execute(
            select(job_events.c.body).where(
                job_events.c.job_id == job_id, job_events.c.topic == "job.deferred"
            )
        )
        total = 0.0
        for (body,) in rows:
            try:
                total += float((body or {}).get("seconds", 0))
            except (TypeError, ValueError, AttributeError):
                continue
        return total

    def _take(
        self, conn: Connection, job_id: str, cond: Any, *, owner: str, task_id: str
    ) -> RowMapping | None:
        """The claim CAS. A new attempt starts with no stop request of the last one."""
        stmt = (
            update(jobs)
            .where(jobs.c.id == job_id, cond)
            .values(
                status=s.RUNNING,
                attempts=jobs.c.attempts + 1,
                lease_owner=owner,
                heartbeat_at=db_now(),
                started_at=db_now(),
                updated_at=db_now(),
                celery_task_id=task_id,
                preempt_requested_at=None,
                interrupt_sent_at=None,
            )
            .returning(*jobs.c)
        )
        return conn.execute(stmt).mappings().one_or_none()

    def _takeover_dead(self, conn: Connection, current: RowMapping, *, owner: str, task_id: str) -> Claim:
        """Take over from a holder that is gone; dead-letter it if it used its budget."""
        cond = and_(
            jobs.c.status == s.RUNNING,
            jobs.c.attempts == current["attempts"],
            jobs.c.lease_owner == current["lease_owner"],
        )
        if counted_attempts(current) >= current["max_attempts"]:
            return Claim(ClaimOutcome.WORKER_LOST, current)
        row = self._take(conn, current["id"], cond, owner=owner, task_id=task_id)
        if row is None:
            return Claim(ClaimOutcome.LIVE_LEASE, self.get(conn, current["id"]))
        self.emit(
            conn,
            [
                new_event(
                    row["id"],
                    "job.stalled",
                    {
                        "stage": row["stage"],
                        "previous_owner": current["lease_owner"],
                        "attempt": row["attempts"],
                    },
                )
            ],
        )
        return Claim(ClaimOutcome.RUN, row, took_over=True)

    def _is_stale(self, conn: Connection, job_id: str) -> bool:
        q = select(jobs.c.id).where(
            jobs.c.id == job_id,
            jobs.c.heartbeat_at < db_now_plus(-self.lease_timeout),
            takeovers_allowed(self.lease_timeout),
        )
        return conn.execute(q).first() is not None

    def _expired(self, conn: Connection, job_id: str) -> bool:
        q = select(jobs.c.id).where(jobs.c.id == job_id, jobs.c.expires_at <= db_now())
        return conn.execute(q).first() is not None


def _owner_dead(lease_owner: str | None) -> bool:
    """True when the lease belongs to a process of this node (host, boot and PID namespace,
    see ``conveyor.runfile.local_node``) that no longer exists.

    Lets a redelivered message take over at once after a pool child is killed, instead of
    waiting a full lease timeout for the reconciler. Any other owner (another host, one of
    the same name, an owner in an older format) is judged by its lease alone.
    """
    if not lease_owner:
        return True
    pid = local_pid(lease_owner)
    return pid is not None and not pid_alive(pid)
