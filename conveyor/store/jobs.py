"""Job state transitions. Every status change is a compare-and-set on ``(id, status,
attempts)``: the attempt number is the fencing token and only ever grows. All time
comparisons use the database clock."""

from __future__ import annotations

import datetime as dt
import re
import traceback as tb
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, func, insert, or_, select, update
from sqlalchemy.engine import RowMapping

from conveyor import tracing
from conveyor.errors import JobIdInvalid, describe
from conveyor.logs import redact_text
from conveyor.store.claims import Claim, ClaimOutcome, Claims, counted_attempts
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import (
    db_now,
    db_now_plus,
    is_sqlite,
    pg_statements,
    upsert,
)
from conveyor.store.db.schema import Row, dead_letters, job_events, jobs, new_event
from conveyor.store.events import EventCursor, event_position, resolve_cursor, sequence_events
from conveyor.wire import to_wire

__all__ = [
    "Claim",
    "ClaimOutcome",
    "JobStore",
    "NewJob",
    "Row",
    "counted_attempts",
    "format_traceback",
    "new_event",
    "parse_cursor",
]


@dataclass
class NewJob:
    """A job row about to be inserted."""

    stage: str
    queue: str
    payload: dict[str, Any]
    max_attempts: int
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    priority: int = 0
    label: str | None = None
    idempotency_key: str | None = None  # as stored: an owner's is scoped (conveyor.client.owners)
    owner: str | None = None
    delay: float = 0.0  # relative: added to the database's clock
    expires_in: float | None = None
    run_at: dt.datetime | None = None  # absolute: stored as given (wins over delay)
    expires_at: dt.datetime | None = None
    flow_id: str | None = None
    parent_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    origin_task_id: str | None = None
    status: str = s.QUEUED
    published_epoch: str | None = None  # set: inserted as published now under this epoch
    rerun: bool = False  # set: the row existed and was sent back to queued (republish it)
    dedup_key: str | None = None
    dedup_seq: int | None = None
    plan: Any = None  # its DedupPlan, when its stage (or the submit) declares dedup
    follow: bool = False  # deduplicated, it becomes a follower (something waits on it)
    follows: str | None = None  # set: stored as a follower of this holder
    invalid: tuple[str, str] | None = None  # (error type, message): stored dead-lettered
    # The W3C carrier of the span that created it; unset: the span current at insert.
    trace_context: dict[str, str] | None = None

    @classmethod
    def submitted(
        cls,
        *,
        stage: str,
        queue: str,
        payload: dict[str, Any],
        max_attempts: int,
        priority: int,
        label: str | None,
        idempotency_key: str | None = None,
        owner: str | None = None,
        delay: float = 0.0,
        expires_in: float | None = None,
        run_at: dt.datetime | None = None,
        job_id: str | None = None,
    ) -> NewJob:
        """A job as ``submit()`` records it: its own id (``job_id``, checked by
        :func:`checked_job_id`, or a new UUID) is its first task id, and it is published
        with Celery's ``ignore_result`` (its outcome is the row)."""
        job = cls(
            stage=stage,
            queue=queue,
            payload=payload,
            max_attempts=max_attempts,
            priority=priority,
            label=label,
            idempotency_key=idempotency_key,
            owner=owner,
            delay=max(0.0, delay),
            expires_in=expires_in,
            run_at=run_at,
            options={s.IGNORE_RESULT: True},
        )
        for name, seconds in (("delay", delay), ("expires_in", expires_in)):
            if seconds is not None and seconds > MAX_SECONDS:
                # Postgres would store it, and no reader could read that timestamp back.
                raise ValueError(f"{name} must be at most {MAX_SECONDS} seconds (10 years)")
        if job_id is not None:
            job.id = checked_job_id(job_id)
        job.origin_task_id = job.id
        return job

    @property
    def due_now(self) -> bool:
        """Published at insert. An absolute ``run_at`` is left to the relay, which compares
        it with the database's clock, never the submitter's."""
        return self.delay <= 0 and self.run_at is None


MAX_SECONDS = 10 * 365 * 86400.0  # the longest delay or expiry a submit takes
_JOB_ID = re.compile(rf"[A-Za-z0-9_.-]{{1,{s.JOB_ID_LENGTH}}}")


def checked_job_id(job_id: str) -> str:
    """``job_id`` if it can be a job's id (1-36 letters, digits and ``-_.``, a UUID's
    text fits), else :class:`JobIdInvalid` (which never quotes it)."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise JobIdInvalid(f"job_id must be 1-{s.JOB_ID_LENGTH} letters, digits and '-_.' (a UUID fits)")
    return job_id


class JobStore(Claims):
    """SQL for the job lifecycle; every method takes the caller's connection."""

    def __init__(
        self,
        *,
        lease_timeout: float,
        max_requeues: int = 20,
        detect_local_dead_owners: bool = True,
        requeue_backoff: float = 0.0,
        requeue_backoff_cap: float = 0.0,
    ) -> None:
        self.lease_timeout = lease_timeout
        self.max_requeues = max_requeues
        self.detect_local_dead_owners = detect_local_dead_owners
        self.requeue_backoff = requeue_backoff
        self.requeue_backoff_cap = requeue_backoff_cap

    # -- writes -------------------------------------------------------------------------

    def insert(self, conn: Connection, job: NewJob) -> tuple[str, bool]:
        """Insert ``job`` unless its id or idempotency key exists; return (id, created)."""
        if job.trace_context is None:
            job.trace_context = tracing.carrier()
        values = {
            "id": job.id,
            "stage": job.stage,
            "queue": job.queue,
            "status": job.status,
            "priority": job.priority,
            "payload": job.payload,
            "label": job.label,
            "idempotency_key": job.idempotency_key,
            "owner": job.owner,
            "attempts": 0,
            "max_attempts": job.max_attempts,
            "run_at": job.run_at or (db_now_plus(job.delay) if job.delay > 0 else db_now()),
            "expires_at": job.expires_at
            or (db_now_plus(job.expires_in) if job.expires_in is not None else None),
            "flow_id": job.flow_id or job.id,
            "parent_id": job.parent_id,
            "options": to_wire(job.options) if job.options else job.options,
            "origin_task_id": job.origin_task_id,
            "trace_context": job.trace_context,
            "created_at": db_now(),
            "updated_at": db_now(),
        }
        if job.status in s.TERMINAL:
            values["finished_at"] = db_now()
        if job.published_epoch is not None:
            values.update(
                celery_task_id=job.origin_task_id, published_at=db_now(), broker_epoch=job.published_epoch
            )
        if job.dedup_key is not None:
            values.update(dedup_key=job.dedup_key, dedup_seq=job.dedup_seq)
        stmt = _insert_ignore(conn, values, ["id"] if job.idempotency_key is None else None)
        created = conn.execute(stmt.returning(jobs.c.id)).first() is not None
        if created:
            return job.id, True
        existing = self.find_existing(conn, job.id, job.idempotency_key)
        if existing is None:  # lost a race with a rollback; the caller retries the whole submit
            raise RuntimeError("job insert conflicted but no existing row was found")
        return existing, False

    def insert_submitted(self, conn: Connection, job: NewJob) -> bool:
        """Insert ``job`` with its ``job.submitted`` event; False if it already existed."""
        params = None if is_sqlite(conn) else self.submit_params(job)
        if params is None:
            created = self.insert(conn, job)[1]
            if created:
                self.emit(conn, [new_event(job.id, "job.submitted", {"stage": job.stage})])
            return created
        return conn.execute(pg_statements(conn).submit, params).first() is not None

    def submit_params(self, job: NewJob) -> dict[str, Any] | None:
        """The parameters of the one-statement submit on Postgres (the row and its
        ``job.submitted`` event), or None when ``job`` needs :meth:`insert` (not queued, or
        with an absolute ``run_at``/``expires_at``)."""
        if job.trace_context is None:
            job.trace_context = tracing.carrier()
        if job.status != s.QUEUED or job.run_at or job.expires_at:
            return None
        return {
            "id": job.id,
            "stage": job.stage,
            "queue": job.queue,
            "priority": job.priority,
            "payload": job.payload,
            "label": job.label,
            "idempotency_key": job.idempotency_key,
            "max_attempts": job.max_attempts,
            "delay": max(0.0, job.delay),
            "expires_in": job.expires_in,
            "flow_id": job.flow_id or job.id,
            "parent_id": job.parent_id,
            "options": to_wire(job.options) if job.options else job.options,
            "origin_task_id": job.origin_task_id,
            "celery_task_id": job.origin_task_id if job.published_epoch else None,
            "broker_epoch": job.published_epoch,
            "dedup_key": job.dedup_key,
            "dedup_seq": job.dedup_seq,
            "owner": job.owner,
            "trace_context": job.trace_context,
            "event": {"stage": job.stage},
        }

    def rerun(self, conn: Connection, job: NewJob, *, budget: int, upstream: str) -> bool:
        """Its upstream completed again (after a DLQ retry): give ``job`` the new input.

        A finished continuation goes back to ``queued`` with a fresh attempt budget
        (``attempts`` never decreases) and its open DLQ entry is closed; one still waiting
        takes the new payload in place. Returns True when it must be published again. A
        continuation running right now keeps its old input.
        """
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job.id, jobs.c.status.in_([s.SUCCEEDED, s.SKIPPED, s.DEAD]))
            .values(
                status=s.QUEUED,
                payload=job.payload,
                label=job.label,
                max_attempts=jobs.c.attempts - jobs.c.uncounted + budget,
                run_at=db_now(),
                published_at=None,
                finished_at=None,
                lease_owner=None,
                result=None,
                error_type=None,
                last_error=None,
                updated_at=db_now(),
                # The rerun belongs to the trace of the completion that caused it.
                **({"trace_context": job.trace_context} if job.trace_context else {}),
            )
        )
        if res.rowcount == 1:
            conn.execute(
                update(dead_letters)
                .where(dead_letters.c.job_id == job.id, dead_letters.c.retried_at.is_(None))
                .values(retried_at=db_now(), retried_by="upstream")
            )
            self.emit(conn, [new_event(job.id, "job.rerun", {"stage": job.stage, "upstream": upstream})])
            return True
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job.id, jobs.c.status.in_(s.CLAIMABLE))
            .values(payload=job.payload, label=job.label, updated_at=db_now())
        )
        return False

    def find_existing(self, conn: Connection, job_id: str, key: str | None) -> str | None:
        """The id of the row holding ``job_id`` or idempotency ``key``."""
        cond = jobs.c.id == job_id
        if key is not None:
            cond = or_(cond, jobs.c.idempotency_key == key)
        return conn.execute(select(jobs.c.id).where(cond).limit(1)).scalar_one_or_none()

    def mark_for_publish(self, conn: Connection, job: Row, *, epoch: str | None) -> str | None:
        """CAS a still-claimable job to "published now" with a fresh task id (returned).

        None when the job moved on (claimed, cancelled) since it was read, or was read
        unpublished and someone (the submitter after its caller's commit) published it since.
        """
        task_id = str(uuid.uuid4())
        cas = [jobs.c.id == job["id"], jobs.c.status.in_(s.CLAIMABLE), jobs.c.attempts == job["attempts"]]
        # Still due: a job parked since it was read (its submitter held it back until its
        # token time) must not be published now, to be dropped by a claim that finds it early.
        cas.append(jobs.c.run_at <= db_now())
        if job.get("published_at") is None:
            cas.append(jobs.c.published_at.is_(None))
        values = {"celery_task_id": task_id, "broker_epoch": epoch, "published_at": db_now()}
        res = conn.execute(update(jobs).where(*cas).values(**values))
        return task_id if res.rowcount == 1 else None

    # -- claim --------------------------------------------------------------------------

    def heartbeat(self, conn: Connection, job_id: str, attempt: int) -> bool:
        """Renew the lease; False means this attempt no longer owns the job."""
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == s.RUNNING, jobs.c.attempts == attempt)
            .values(heartbeat_at=db_now())
        )
        return res.rowcount == 1

    # -- completion ---------------------------------------------------------------------

    def succeed(self, conn: Connection, job_id: str, attempt: int, result: Any) -> bool:
        """CAS ``running → succeeded`` for this attempt; False if the attempt was fenced off."""
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == s.RUNNING, jobs.c.attempts == attempt)
            .values(
                status=s.SUCCEEDED,
                result=result,
                lease_owner=None,
                finished_at=db_now(),
                updated_at=db_now(),
            )
        )
        return res.rowcount == 1

    def succeed_with_event(
        self, conn: Connection, job_id: str, attempt: int, result: Any, stage: str
    ) -> bool:
        """:meth:`succeed` plus its ``job.succeeded`` event (one statement on Postgres)."""
        if is_sqlite(conn):
            ok = self.succeed(conn, job_id, attempt, result)
            if ok:
                self.emit(conn, [new_event(job_id, "job.succeeded", {"stage": stage})])
            return ok
        params = {"id": job_id, "attempt": attempt, "result": result, "event": {"stage": stage}}
        return conn.execute(pg_statements(conn).succeed, params).first() is not None

    def schedule_retry(
        self, conn: Connection, job: Row, attempt: int, delay: float, error: BaseException
    ) -> bool:
        """CAS ``running → retrying`` with ``run_at`` in the future; the relay republishes."""
        res = conn.execute(
            update(jobs)
            .where(jobs.c.id == job["id"], jobs.c.status == s.RUNNING, jobs.c.attempts == attempt)
            .values(
                status=s.RETRYING,
                run_at=db_now_plus(delay),
                published_at=None,
                lease_owner=None,
                error_type=type(error).__name__,
                last_error=_message(error),
                updated_at=db_now(),
            )
        )
        return res.rowcount == 1

    def dead_letter(
        self,
        conn: Connection,
        job: Row,
        *,
        error_type: str,
        message: str,
        tb_text: str | None,
        attempt: int | None = None,
        from_status: Iterable[str] = (s.RUNNING,),
    ) -> bool:
        """CAS the job to ``dead`` and write its DLQ entry, in ``conn``'s transaction.

        The message and traceback are scrubbed of secrets as logs are (``conveyor.logs``):
        people read them in the CLI, the console and the API."""
        message = redact_text(message)
        tb_text = redact_text(tb_text) if tb_text else tb_text
        ok = self.finish(
            conn,
            job,
            s.DEAD,
            from_status=from_status,
            attempt=attempt,
            topic="job.dead",
            body={"error_type": error_type, "message": message},
            error=message,
        )
        if ok:
            conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(error_type=error_type))
            conn.execute(
                insert(dead_letters).values(
                    job_id=job["id"],
                    stage=job["stage"],
                    queue=job["queue"],
                    label=job["label"],
                    error_type=error_type,
                    message=message,
                    traceback=tb_text,
                    attempts=job["attempts"] if attempt is None else attempt,
                    created_at=db_now(),
                )
            )
        return ok

    def record_garbage(
        self, conn: Connection, *, error_type: str, message: str, headers: Mapping[str, Any]
    ) -> None:
        """A message no stage can run: DLQ entry with its headers (never its body)."""
        conn.execute(
            insert(dead_letters).values(
                job_id=None,
                stage=str(headers.get("task") or "") or None,
                queue=None,
                label=None,
                error_type=error_type,
                message=message,
                headers=dict(headers),
                attempts=0,
                created_at=db_now(),
            )
        )
        self.emit(conn, [new_event(None, "message.rejected", {"error_type": error_type})])

    # -- reads --------------------------------------------------------------------------

    def events_since(
        self, conn: Connection, cursor: str | None, *, job_id: str | None = None, limit: int = 500
    ) -> tuple[list[RowMapping], str | None]:
        """Events after ``cursor`` in commit order, and the cursor to pass next time.

        Every event committed before the call is included (the sequencer runs first, see
        :mod:`conveyor.store.events`); one still uncommitted comes in a later call, after these.
        Each row has a ``position``: ``str(row["position"])`` is the cursor right after it.
        With no new events the cursor comes back unchanged (an old ``"txid:id"`` one in
        today's form).
        """
        parsed = parse_cursor(cursor)
        sequence_events(conn)
        after = resolve_cursor(conn, parsed)
        position = event_position(conn)
        q = select(job_events, position.label("position")).where(position > after)
        if job_id is not None:
            q = q.where(job_events.c.job_id == job_id)
        rows = list(conn.execute(q.order_by(position).limit(limit)).mappings())
        if not rows:
            return rows, None if cursor is None else str(after)
        return rows, str(rows[-1]["position"])

    def count_by_status(self, conn: Connection, stage: str | None = None) -> dict[str, int]:
        """Job counts per status (optionally of one stage)."""
        q = select(jobs.c.status, func.count()).group_by(jobs.c.status)
        if stage is not None:
            q = q.where(jobs.c.stage == stage)
        return {str(k): int(v) for k, v in conn.execute(q)}


def parse_cursor(cursor: str | None) -> EventCursor:
    """A cursor from :meth:`JobStore.events_since` → where to resume; None → the beginning.

    Cursors are event positions (``"1234"``). A ``"txid:id"`` cursor from before migration
    0009 resumes right after event ``id``. Raises ValueError for anything else.
    """
    if not cursor:
        return EventCursor()
    txid, sep, eid = cursor.partition(":")
    if sep:
        int(txid)  # validated only: event ``id`` alone locates where the old reader was
        legacy = int(eid)
        if legacy < 0:
            raise ValueError(f"bad event cursor {cursor!r}")
        return EventCursor(legacy_id=legacy)
    after = int(cursor)
    if after < 0:
        raise ValueError(f"bad event cursor {cursor!r}")
    return EventCursor(after=after)


def _insert_ignore(conn: Connection, values: dict[str, Any], index: list[str] | None) -> Any:
    stmt = upsert(conn, jobs).values(**values)
    return stmt.on_conflict_do_nothing(index_elements=index) if index else stmt.on_conflict_do_nothing()


def _message(error: BaseException) -> str:
    return redact_text(describe(error)[:2000])


def format_traceback(error: BaseException) -> str:
    """The traceback of ``error`` as text, bounded."""
    return "".join(tb.format_exception(type(error), error, error.__traceback__))[-8000:]
