"""How an attempt ends: one completion transaction, or a retry, or the dead-letter queue.

A body that returned commits its writes, its ``succeeded`` (or ``skipped``) compare-and-set,
its events and its continuation in one transaction. A body that raised is retried with
its stage's backoff or dead-lettered, decided by the error class and the budget. A write
refused by the fencing compare-and-set (a newer attempt owns the job) records nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from sqlalchemy import update

from conveyor import tracing
from conveyor.client.owners import owned_key
from conveyor.delivery.connections import Connections
from conveyor.errors import (
    Deferred,
    LeaseLost,
    RetryRequested,
    TransientError,
    describe,
    is_connection_loss,
    is_permanent,
)
from conveyor.metrics import Metrics
from conveyor.runfile import lease_owner
from conveyor.stage import StageSpec
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import JobStore, NewJob, Row, counted_attempts, format_traceback, new_event
from conveyor.wire import from_wire
from conveyor.worker.context import JobContext
from conveyor.worker.continuations import Continuations
from conveyor.worker.flow import Flow
from conveyor.worker.heartbeat import Heartbeat
from conveyor.worker.leases import Leases

log = logging.getLogger("conveyor.completion")


class Completion:
    """Records the end of an attempt: success, retry or dead letter."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        continuations: Continuations,
        flow: Flow,
        heartbeat: Heartbeat,
        metrics: Metrics,
        leases: Leases,
    ) -> None:
        self.connections = connections
        self.leases = leases
        self.store = store
        self.continuations = continuations
        self.flow = flow
        self.heartbeat = heartbeat
        self.metrics = metrics

    def complete(
        self,
        task: Task,
        spec: StageSpec,
        job: Row,
        ctx: JobContext,
        result: Any,
        skipped: str | None = None,
    ) -> None:
        """Commit the stage's writes, its ``succeeded`` (or ``skipped``) CAS, its events and
        its continuation, in one transaction (a ``conveyor.complete`` span: the
        continuations' submits are its children)."""
        attributes = {"conveyor.job_id": job["id"], "conveyor.outcome": "skipped" if skipped else "succeeded"}
        with tracing.span("conveyor.complete", attributes=attributes):
            self._complete(task, spec, job, ctx, result, skipped)

    def _complete(
        self, task: Task, spec: StageSpec, job: Row, ctx: JobContext, result: Any, skipped: str | None
    ) -> None:
        store = self.store
        conn = ctx.take_connection()
        simple = (
            skipped is None
            and not ctx.events
            and not ctx.children
            and not task.request.chain
            and not task.request.callbacks
        )
        lane = self.connections.lane if conn is None and simple else None
        if lane is not None:
            # Nothing but the completion itself to commit: one statement, autocommit.
            if not lane.succeed(job["id"], int(job["attempts"]), result, spec.name):
                raise LeaseLost(f"job {job['id']} attempt {job['attempts']} was taken over")
            self.metrics.inc("succeeded", spec.name)
            self._release_lease(ctx)
            self._after_commit(task, job, result, [])
            return
        own = conn is None
        if conn is None:
            conn = self.connections.engine.connect()
            conn.begin()
        continuation: list[NewJob] = []
        try:
            if skipped is not None:
                ok = store.finish(
                    conn,
                    job,
                    s.SKIPPED,
                    from_status=(s.RUNNING,),
                    attempt=int(job["attempts"]),
                    topic="job.skipped",
                    body={"reason": skipped},
                )
                if ok:
                    conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(result=result))
            else:
                ok = store.succeed_with_event(conn, job["id"], int(job["attempts"]), result, spec.name)
            if not ok:
                raise LeaseLost(f"job {job['id']} attempt {job['attempts']} was taken over")
            store.emit(conn, ctx.events)
            continuation = self.continuations.take_over(conn, task.request, job, result)
            if ctx.children:
                for child in ctx.children:
                    child.owner = job["owner"]
                    child.idempotency_key = owned_key(job["owner"], child.idempotency_key)
                continuation += self.continuations.insert(conn, ctx.children, upstream=str(job["id"]))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            if own:
                conn.close()
        self.metrics.inc("succeeded", spec.name)
        self._release_lease(ctx)
        self._after_commit(task, job, result, continuation)

    def _release_lease(self, ctx: JobContext) -> None:
        """The job's lease key goes back before its waiters wake: a caller whose ``wait()``
        returned finds the key free (and the next parked job unparked)."""
        held, ctx.held = ctx.held, None
        if held is not None:
            self.leases.release(held, ctx.job_id)

    def _after_commit(self, task: Task, job: Row, result: Any, continuation: list[NewJob]) -> None:
        self.flow.publish_continuations(continuation)
        try:
            self.flow.finished(job["id"], s.SUCCEEDED, dedup_key=job["dedup_key"])
        except Exception:
            log.warning("post-commit notification failed for %s", job["id"], exc_info=True)
        origin = job["origin_task_id"]
        if origin and origin != task.request.id and s.wants_celery_result(job):
            # Callers holding the first AsyncResult (chains, send_task) still see the outcome.
            self._store_origin(task, origin, result)

    def _store_origin(self, task: Task, origin: str, result: Any) -> None:
        try:
            task.backend.store_result(origin, from_wire(result), "SUCCESS")
        except Exception:
            log.warning("could not store the result of task %s", origin, exc_info=True)

    # -- failure ------------------------------------------------------------------------

    def fail(
        self, task: Task, spec: StageSpec, job: Row, attempt: int, exc: BaseException
    ) -> tuple[Any] | None:
        """Retry with backoff, or dead-letter: decided by the error class and the budget.

        A stage with ``on_dead`` is dead-lettered *and* carries on: the hook's result goes
        down the flow (returned here as a 1-tuple), so a chord never waits on a dead member.
        A failure of an attempt that no longer owns the job (fenced off) writes nothing.
        """
        with tracing.span("conveyor.fail", attributes={"conveyor.job_id": job["id"]}):
            return self._fail(task, spec, job, attempt, exc)

    def _fail(
        self, task: Task, spec: StageSpec, job: Row, attempt: int, exc: BaseException
    ) -> tuple[Any] | None:
        store = self.store
        carried: tuple[Any] | None = None
        continuation: list[NewJob] = []
        permanent = is_permanent(exc)
        timed_out = isinstance(exc, SoftTimeLimitExceeded)
        if timed_out and not spec.retry_on_timeout:
            permanent = True
        counted = counted_attempts(job)
        budget = int(job["max_attempts"])
        if isinstance(exc, RetryRequested) and exc.max_attempts is not None:
            budget = exc.max_attempts  # Celery's retry(max_retries=...) decides for itself
        exhausted = counted >= budget
        if isinstance(exc, RetryRequested) and exhausted and exc.cause is not None:
            exc = exc.cause  # as Celery: past its retries, the task fails with the error it gave
        try:
            with self.connections.engine.begin() as conn:
                if permanent or exhausted:
                    message = _readable(exc, spec, counted, budget, exhausted and not permanent)
                    if not store.dead_letter(
                        conn,
                        job,
                        error_type=type(exc).__name__,
                        message=message,
                        tb_text=format_traceback(exc),
                        attempt=attempt,
                    ):
                        raise LeaseLost(f"job {job['id']} attempt {attempt} was taken over")
                    carried = self.flow.carry_on(conn, job, exc)
                    if carried is not None:
                        continuation = self.continuations.take_over(conn, task.request, job, carried[0])
                    else:
                        continuation = self.continuations.take_errbacks(conn, task.request, job, exc)
                    status = s.DEAD
                else:
                    settings = self.connections.settings
                    delay = spec.retry.delay(
                        counted, default_base=settings.backoff_base, default_cap=settings.backoff_cap
                    )
                    if isinstance(exc, RetryRequested) and exc.delay is not None:
                        delay = max(0.0, exc.delay)
                    if not store.schedule_retry(conn, job, attempt, delay, exc):
                        raise LeaseLost(f"job {job['id']} attempt {attempt} was taken over")
                    body = {
                        "stage": spec.name,
                        "attempt": counted,
                        "delay": round(delay, 3),
                        "error_type": type(exc).__name__,
                    }
                    store.emit(conn, [new_event(job["id"], "job.retrying", body)])
                    status = s.RETRYING
        except LeaseLost:
            # The compare-and-set was refused: a newer attempt owns the job. Nothing of
            # this failure was written (no event, no metric); the message is done with.
            log.info("failure of job %s attempt %s ignored: fenced off", job["id"], attempt)
            raise Ignore() from None
        except Exception as db_exc:
            if not is_connection_loss(db_exc):
                raise
            log.warning("could not record failure of %s; requeueing it uncounted", job["id"])
            self.heartbeat.requeue_uncounted(job["id"], attempt, lease_owner(), "infrastructure")
            raise Reject(exc, requeue=True) from None
        if status == s.DEAD:
            self.metrics.inc("dead", spec.name)
            self.flow.publish_continuations(continuation)
            self.flow.finished(job["id"], s.DEAD, dedup_key=job["dedup_key"])
            origin = job["origin_task_id"]
            if origin and origin != task.request.id:
                # Celery stores this delivery's outcome; the caller holds the first task id.
                if carried is None:
                    self.flow.report_failure(origin, {}, exc)
                else:
                    self._store_origin(task, origin, carried[0])
            return carried
        else:
            self.metrics.inc("retried", spec.name)
            # The relay republishes when due; Celery must not retry or store a failure.
            raise Ignore()

    # -- deferral -----------------------------------------------------------------------

    def defer(self, task: Task, spec: StageSpec, job: Row, attempt: int, exc: Deferred) -> tuple[Any] | None:
        """Park the job ``exc.seconds`` (uncounted), or, past the stage's ``max_deferred``
        seconds in all, fail the attempt as an ordinary transient failure."""
        over: TransientError | None = None
        done = False
        with tracing.span("conveyor.defer", attributes={"conveyor.job_id": job["id"]}):
            try:
                with self.connections.engine.begin() as conn:
                    total = self.store.deferred_so_far(conn, job["id"])
                    if total + exc.seconds > spec.max_deferred:
                        over = TransientError(
                            f"deferred {round(total, 1):g}s in all, and {round(exc.seconds, 1):g}s more "
                            f"would pass the stage's max_deferred of {spec.max_deferred:g}s: {exc.reason}"
                        )
                    else:
                        done = self.store.defer(
                            conn, job["id"], attempt, lease_owner(), seconds=exc.seconds, reason=exc.reason
                        )
            except Exception as db_exc:
                if not is_connection_loss(db_exc):
                    raise
                log.warning("could not record deferral of %s; requeueing it uncounted", job["id"])
                self.heartbeat.requeue_uncounted(job["id"], attempt, lease_owner(), "infrastructure")
                raise Reject(exc, requeue=True) from None
        if over is not None:
            return self.fail(task, spec, job, attempt, over)
        if not done:
            log.info("deferral of job %s attempt %s ignored: fenced off", job["id"], attempt)
        else:
            self.metrics.inc("deferred", spec.name)
        # The relay publishes it again when due; Celery must not retry or store anything.
        raise Ignore()

    def record_hard_timeout(self, spec: StageSpec, task_id: str, exc: BaseException) -> None:
        """Called in the worker's main process after it killed the child at the hard limit."""
        store = self.store
        try:
            with self.connections.engine.begin() as conn:
                row = (
                    conn.execute(
                        jobs.select().where(jobs.c.celery_task_id == task_id, jobs.c.status == s.RUNNING)
                    )
                    .mappings()
                    .one_or_none()
                )
                if row is None:
                    return
                attempt = int(row["attempts"])
                if spec.retry_on_timeout and counted_attempts(row) < int(row["max_attempts"]):
                    settings = self.connections.settings
                    delay = spec.retry.delay(
                        counted_attempts(row),
                        default_base=settings.backoff_base,
                        default_cap=settings.backoff_cap,
                    )
                    store.schedule_retry(conn, row, attempt, delay, exc)
                    return
                burial = self.flow.bury(
                    conn,
                    row,
                    error=exc,
                    message=f"{spec.name} exceeded its hard time limit ({exc}) and was killed",
                    attempt=attempt,
                )
            self.flow.after_burial(burial)
        except Exception:
            log.warning(
                "could not record hard timeout of task %s; the reconciler will", task_id, exc_info=True
            )


def _readable(exc: BaseException, spec: StageSpec, attempt: int, max_attempts: int, exhausted: bool) -> str:
    text = describe(exc)
    if isinstance(exc, SoftTimeLimitExceeded):
        text = f"{spec.name} exceeded its soft time limit"
    if exhausted:
        return f"gave up after {attempt} of {max_attempts} attempts: {text}"[:2000]
    return text[:2000]


__all__ = ["Completion"]
