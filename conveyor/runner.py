"""The stage lifecycle inside a worker: claim → body → one completion transaction."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from sqlalchemy import update

from conveyor.admission import Slot
from conveyor.broker import JOB_HEADER
from conveyor.context import JobContext
from conveyor.db import schema as s
from conveyor.db.schema import jobs
from conveyor.errors import (
    Cancelled,
    Interrupted,
    LeaseLost,
    PayloadInvalid,
    RequeuesExhausted,
    SkipJob,
    WorkerLost,
    describe,
    is_connection_loss,
    is_permanent,
    is_stopped_by_worker,
)
from conveyor.followers import has_flow
from conveyor.heartbeat import Heartbeat
from conveyor.leases import PREEMPT, Held, format_key
from conveyor.runfile import owner_id
from conveyor.stage import StageSpec, StageTask, kept_if_small, payload_from_call, to_jsonable
from conveyor.store import Claim, ClaimOutcome, NewJob, Row, counted_attempts, format_traceback, new_event

if TYPE_CHECKING:
    from conveyor.platform import Platform

log = logging.getLogger("conveyor.runner")


def lease_owner() -> str:
    """``node:pid`` (plus the thread for in-process thread workers); see ``owner_id``."""
    main = threading.current_thread() is threading.main_thread()
    return owner_id(thread=None if main else threading.get_ident())


class Runner:
    """Runs one delivered message of a stage through the job lifecycle."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.heartbeat = Heartbeat(platform)

    # -- entry points -------------------------------------------------------------------

    def run_inline(self, spec: StageSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A direct function call (``stage(...)``): validate and run, no job row."""
        payload = spec.validate(payload_from_call(args, kwargs))
        ctx = JobContext(self.platform, job_id="inline", attempt=1, stage=spec.name, flow_id=None)
        try:
            return to_jsonable(spec.fn(ctx, payload))
        finally:
            ctx.close()

    def execute(self, task: StageTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Claim the job of this delivery and run it; see the class docs of the outcomes."""
        spec = task.spec
        req = task.request
        store = self.platform.store
        owner = lease_owner()
        slot = None
        try:
            job_id = _header(req, JOB_HEADER)
            if job_id is not None:
                slot = self._admit(spec, req, job_id)
            claim: Claim | None = None
            if job_id is not None:
                with self.platform.autocommit() as conn:
                    row = store.fast_claim(conn, job_id, owner=owner, task_id=req.id)
                claim = Claim(ClaimOutcome.RUN, row) if row is not None else None
            if claim is None:
                with self.platform.engine.begin() as conn:
                    if job_id is None:
                        job_id = self._adopt(conn, spec, req, args, kwargs)
                    claim = store.claim(conn, job_id, owner=owner, task_id=req.id)
                    if claim.took_over and claim.job is not None:
                        self.platform.record_stalled(conn, claim.job, int(claim.job["attempts"]) - 1)
        except Exception as exc:
            if not is_connection_loss(exc):
                raise
            self._release_slot(slot)
            log.warning("infrastructure error before claim (%s); requeueing", type(exc).__name__)
            time.sleep(self.platform.settings.infra_backoff)
            raise Reject(exc, requeue=True) from None

        job = claim.job
        if claim.outcome is ClaimOutcome.RUN:
            assert job is not None
            self.platform.metrics.inc("claimed", spec.name)
            return self._run(task, spec, job, slot)
        self._release_slot(slot)
        if claim.outcome in (ClaimOutcome.WORKER_LOST, ClaimOutcome.REQUEUES_EXHAUSTED):
            assert job is not None
            self._bury_lost(job, requeues=claim.outcome is ClaimOutcome.REQUEUES_EXHAUSTED)
            raise Ignore()
        if claim.outcome is ClaimOutcome.ALREADY_SUCCEEDED:
            assert job is not None
            return self._replay_success(task, job)
        assert job_id is not None
        self._record_skip(job_id, claim.outcome, req.id)
        if claim.outcome is ClaimOutcome.TERMINAL and job is not None:
            self.platform.finished(job_id, job["status"], dedup_key=job["dedup_key"])
        raise Ignore()

    # -- running ------------------------------------------------------------------------

    def _admit(self, spec: StageSpec, req: Any, job_id: str) -> Slot | None:
        """Check the queue's rate limit and the stage's concurrency cap before the claim.

        Over a limit, the job is parked ``throttled`` (visible, never dropped) and this
        delivery is acked; the relay publishes the job again when its ``run_at`` comes.
        """
        queue = _queue_of(req, spec)
        rate = self.platform.settings.rate_limits.get(queue)
        if rate is None and spec.concurrency is None:
            return None
        verdict = self.platform.admission.check(
            queue=queue, rate=rate, stage=spec.name, concurrency=spec.concurrency, job_id=job_id
        )
        if verdict.reason is None:
            return verdict.slot
        body = {"stage": spec.name, "queue": queue, "reason": verdict.reason}
        with self.platform.engine.begin() as conn:
            parked = self.platform.store.throttle(conn, job_id, wait=verdict.wait, body=body)
        if not parked:
            return None  # not waiting to be claimed: the claim below says why
        self.platform.metrics.inc("throttled", spec.name)
        raise Ignore()

    def _release_slot(self, slot: Slot | None) -> None:
        if slot is not None:
            try:
                self.platform.admission.release(slot)
            except Exception:  # the slot expires on its own
                log.warning("could not release concurrency slot %s", slot.key, exc_info=True)

    def _run(self, task: StageTask, spec: StageSpec, job: Row, slot: Slot | None = None) -> Any:
        self.heartbeat.install_interrupt_handler()
        attempt = int(job["attempts"])
        ctx = JobContext(
            self.platform,
            job_id=job["id"],
            attempt=attempt,
            stage=spec.name,
            flow_id=job["flow_id"],
            queue=job["queue"],
        )
        ctx.slot = slot
        self.heartbeat.track(ctx)
        started = time.monotonic()
        try:
            payload = spec.validate(job["payload"])
            if spec.lease_key:
                ctx.held = self._take_lease(ctx, spec, payload)
            result = to_jsonable(spec.fn(ctx, payload))
            ctx.checkpoint(fresh=False)  # the body is done: the polled flag is enough
            self._complete(task, spec, job, ctx, result)
            self.platform.metrics.observe_runtime(spec.name, time.monotonic() - started)
            return result
        except (Ignore, Reject):
            raise
        except SkipJob as skip:
            result = to_jsonable(skip.result)
            self._complete(task, spec, job, ctx, result, skipped=skip.reason)
            return result
        except Interrupted as exc:
            ctx.close()
            if ctx.held is not None:
                # Hand the lease over first: the preemptor waiting for it should not wait
                # for this job's requeue transaction too (it is reserved for the preemptor).
                self.platform.leases.release(ctx.held, ctx.job_id)
                ctx.held = None
            self._interrupted(spec, job, attempt, exc)
            raise Ignore() from None
        except BaseException as exc:
            ctx.close()
            if is_stopped_by_worker(exc):
                # The worker ended this job (a cold shutdown, or Celery cancelling jobs on a
                # broker connection loss): not the job's failure. Requeue it uncounted and
                # let the process exit as billiard asked.
                log.warning("%s stopped by its worker; requeueing uncounted", spec.name)
                self.requeue_uncounted(job["id"], attempt, lease_owner(), "worker_stopped")
                raise
            if is_connection_loss(exc):
                # The attempt's transaction died with the database: nothing was recorded.
                # Requeue the job without counting the attempt (now, or once the database
                # answers again) and give the message back to the broker.
                log.warning("infrastructure error in %s (%s); requeueing", spec.name, type(exc).__name__)
                self.requeue_uncounted(job["id"], attempt, lease_owner(), "infrastructure")
                time.sleep(self.platform.settings.infra_backoff)
                raise Reject(exc, requeue=True) from None
            carried_on = self._fail(task, spec, job, attempt, exc)
            if carried_on is not None:
                return carried_on[0]
            raise
        finally:
            self.heartbeat.track(None)
            ctx.close()
            self._release_slot(slot)
            if ctx.held is not None:
                self.platform.leases.release(ctx.held, ctx.job_id)

    def _take_lease(self, ctx: JobContext, spec: StageSpec, payload: Any) -> Held:
        """Hold the stage's lease key, preempting a lower-priority holder if allowed.

        A job that cannot have the lease is parked (``waiting_lease``: no pool slot) and the
        message is acked; only a preemptor with a request in flight waits here, woken by the
        release, for at most the wait budget. Returns the lease held.
        """
        assert spec.lease_key is not None
        p = self.platform
        leases = p.leases
        key = format_key(spec.lease_key, payload.model_dump(mode="json"))
        owner = lease_owner()
        deadline = time.monotonic() + p.settings.preempt_wait_budget
        token = None
        while True:
            requested: tuple[str, int, str | None] | None = None
            with p.engine.begin() as conn:
                token = token or leases.next_token(conn)
                lease = leases.try_acquire(
                    conn,
                    key=key,
                    job_id=ctx.job_id,
                    attempt=ctx.attempt,
                    priority=spec.priority,
                    preemptable=spec.preemptable,
                    token=token,
                )
                if lease is None:
                    conn.execute(update(jobs).where(jobs.c.id == ctx.job_id).values(lease_key=key))
                    return Held(key, token)
                preempting = leases.request_preemption(conn, lease, by_job=ctx.job_id, priority=spec.priority)
                if preempting and lease["holder_job"]:
                    holder = p.store.get(conn, lease["holder_job"])
                    if holder is not None and holder["status"] == s.RUNNING:
                        requested = (holder["id"], int(holder["attempts"]), holder["celery_task_id"])
            if requested is not None:
                leases.flag(requested[0], requested[1], PREEMPT, requested[2])
            left = deadline - time.monotonic()
            if not preempting or left <= 0:
                leases.park(ctx, key, owner)
                raise Ignore()
            leases.wait_for_release(key, min(left, 1.0))

    def _interrupted(self, spec: StageSpec, job: Row, attempt: int, exc: Interrupted) -> None:
        """A checkpoint (or the escalation signal) stopped the body."""
        p = self.platform
        owner = lease_owner()
        cancelled = isinstance(exc, Cancelled)
        with p.engine.begin() as conn:
            if cancelled:
                done = p.store.finish(
                    conn,
                    job,
                    s.CANCELLED,
                    from_status=(s.RUNNING,),
                    attempt=attempt,
                    topic="job.cancelled",
                    body={"while": "running"},
                )
            else:
                outcome = p.store.release_uncounted(
                    conn, job["id"], attempt, owner, "preempted", topic="job.preempted", requeue=False
                )
                done = outcome == "released"
        p.leases.clear_flag(job["id"])
        if not done:  # fenced off: a newer attempt owns the job; nothing was written
            log.info("job %s attempt %s was stopped but no longer owns the job", job["id"], attempt)
            return
        p.metrics.inc("cancelled" if cancelled else "preempted", spec.name)
        if cancelled:
            p.finished(job["id"], s.CANCELLED, dedup_key=job["dedup_key"])

    def _complete(
        self,
        task: StageTask,
        spec: StageSpec,
        job: Row,
        ctx: JobContext,
        result: Any,
        skipped: str | None = None,
    ) -> None:
        """Commit the stage's writes, its ``succeeded`` (or ``skipped``) CAS, its events and
        its continuation, in one transaction."""
        store = self.platform.store
        conn = ctx.take_connection()
        simple = skipped is None and not ctx.events and not task.request.chain and not task.request.callbacks
        if conn is None and simple:
            # Nothing but the completion itself to commit: one statement, autocommit.
            with self.platform.autocommit() as ac:
                if not store.succeed_with_event(ac, job["id"], int(job["attempts"]), result, spec.name):
                    raise LeaseLost(f"job {job['id']} attempt {job['attempts']} was taken over")
            self.platform.metrics.inc("succeeded", spec.name)
            self._after_commit(task, job, result, [])
            return
        own = conn is None
        if conn is None:
            conn = self.platform.engine.connect()
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
            continuation = self._take_over_continuation(conn, task, job, result)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            if own:
                conn.close()
        self.platform.metrics.inc("succeeded", spec.name)
        self._after_commit(task, job, result, continuation)

    def _continuations(self, task: StageTask, job: Row, result: Any) -> list[NewJob]:
        """The jobs this delivery's next chain link and link callbacks become.

        Conveyor takes them over from Celery (clearing them from the request) when they are
        stages; links to plain tasks stay with Celery. Their ids are fixed by the canvas, so
        computing them again (a redelivered copy) finds the same jobs.
        """
        req = task.request
        extra = {"parent_id": req.id, "root_id": req.root_id or req.id}
        created, took_chain, took_callbacks = self.platform.next_jobs(
            list(req.chain or []), list(req.callbacks or []), job, result, extra
        )
        if took_chain:
            req.chain = None
        if took_callbacks:
            req.callbacks = None
        return created

    def _take_over_continuation(self, conn: Any, task: StageTask, job: Row, result: Any) -> list[NewJob]:
        """Create the continuation's jobs in the completion transaction.

        Celery would publish them right after the body returns; doing it here makes the
        continuation commit atomically with the completion, so a kill between the two can
        never strand a flow. A continuation that exists already runs again with the new
        result (this job was retried from the DLQ): the flow resumes from here.
        """
        created = self._continuations(task, job, result)
        return self.platform.insert_continuations(conn, created, upstream=str(job["id"]))

    def _after_commit(self, task: StageTask, job: Row, result: Any, continuation: list[NewJob]) -> None:
        self.platform.publish_continuations(continuation)
        try:
            self.platform.finished(job["id"], s.SUCCEEDED, dedup_key=job["dedup_key"])
            origin = job["origin_task_id"]
            if origin and origin != task.request.id:
                # Callers holding the first AsyncResult (chains do) still see the outcome.
                task.backend.store_result(origin, result, "SUCCESS")
        except Exception:
            log.warning("post-commit notification failed for %s", job["id"], exc_info=True)

    def _replay_success(self, task: StageTask, job: Row) -> Any:
        """A copy of a job that already succeeded: the body does not run again. Its
        continuation committed with the completion; the relay publishes it if its message
        was lost, so this copy needs to write nothing."""
        self._record_skip(job["id"], ClaimOutcome.ALREADY_SUCCEEDED, task.request.id)
        req = task.request
        req.chain = req.callbacks = None  # already taken over at completion
        if req.chord:
            # Celery would count this copy in the chord under its own task id, and a copy
            # republished with a fresh id would count twice (the body fires early). Count
            # it under the delivery that succeeded instead: Celery dedupes that one, and
            # if the worker died before counting it, this counts it now.
            self.platform.count_in_chord(job, "SUCCESS", job["result"])
            raise Ignore()
        return job["result"]

    # -- failure ------------------------------------------------------------------------

    def _fail(
        self, task: StageTask, spec: StageSpec, job: Row, attempt: int, exc: BaseException
    ) -> tuple[Any] | None:
        """Retry with backoff, or dead-letter: decided by the error class and the budget.

        A stage with ``on_dead`` is dead-lettered *and* carries on: the hook's result goes
        down the flow (returned here as a 1-tuple), so a chord never waits on a dead member.
        A failure of an attempt that no longer owns the job (fenced off) writes nothing.
        """
        store = self.platform.store
        carried: tuple[Any] | None = None
        continuation: list[NewJob] = []
        permanent = is_permanent(exc)
        timed_out = isinstance(exc, SoftTimeLimitExceeded)
        if timed_out and not spec.retry_on_timeout:
            permanent = True
        counted = counted_attempts(job)
        exhausted = counted >= int(job["max_attempts"])
        try:
            with self.platform.engine.begin() as conn:
                if permanent or exhausted:
                    message = _readable(
                        exc, spec, counted, int(job["max_attempts"]), exhausted and not permanent
                    )
                    if not store.dead_letter(
                        conn,
                        job,
                        error_type=type(exc).__name__,
                        message=message,
                        tb_text=format_traceback(exc),
                        attempt=attempt,
                    ):
                        raise LeaseLost(f"job {job['id']} attempt {attempt} was taken over")
                    carried = self.platform.carry_on(conn, job, exc)
                    if carried is not None:
                        continuation = self._take_over_continuation(conn, task, job, carried[0])
                    status = s.DEAD
                else:
                    settings = self.platform.settings
                    delay = spec.retry.delay(
                        counted, default_base=settings.backoff_base, default_cap=settings.backoff_cap
                    )
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
            self.requeue_uncounted(job["id"], attempt, lease_owner(), "infrastructure")
            raise Reject(exc, requeue=True) from None
        if status == s.DEAD:
            self.platform.metrics.inc("dead", spec.name)
            self.platform.publish_continuations(continuation)
            self.platform.finished(job["id"], s.DEAD, dedup_key=job["dedup_key"])
            return carried
        else:
            self.platform.metrics.inc("retried", spec.name)
            # The relay republishes when due; Celery must not retry or store a failure.
            raise Ignore()

    def _bury_lost(self, job: Row, *, requeues: bool = False) -> None:
        """The last attempt's worker died, or the job was requeued uncounted too often:
        dead-letter it, and carry on its flow."""
        if requeues:
            message = (
                f"infrastructure kept failing: requeued {job['requeues']} times without counting "
                f"an attempt (limit {self.platform.store.max_requeues}); giving up"
            )
            error: BaseException = RequeuesExhausted(message)
        else:
            message = (
                f"the worker running attempt {counted_attempts(job)} of {job['max_attempts']} "
                "died (crash, OOM or kill); giving up"
            )
            error = WorkerLost(message)
        with self.platform.engine.begin() as conn:
            burial = self.platform.bury(conn, job, error=error, message=message)
        self.platform.after_burial(burial)

    def requeue_uncounted(
        self, job_id: str, attempt: int | None, owner: str, reason: str, *, defer: bool = True
    ) -> str:
        """Requeue an attempt stopped by an outage or a shutdown without counting it; past
        ``max_requeues`` dead-letter the job ("infrastructure kept failing") instead. With
        the database unreachable and ``defer``, the heartbeat thread retries it.

        Returns ``"released"``, ``"exhausted"`` (dead-lettered), ``"refused"`` (the attempt
        no longer owns the job: it finished, or was taken over) or ``"deferred"``.
        """
        p = self.platform
        try:
            with p.engine.begin() as conn:
                outcome = p.store.release_uncounted(conn, job_id, attempt, owner, reason)
                row = p.store.get(conn, job_id) if outcome == "exhausted" else None
            if row is not None:
                self._bury_lost(row, requeues=True)
            return outcome
        except Exception as exc:
            if not (defer and attempt is not None and is_connection_loss(exc)):
                raise
            self.heartbeat.release_later(job_id, attempt, owner)
            return "deferred"

    def record_hard_timeout(self, spec: StageSpec, task_id: str, exc: BaseException) -> None:
        """Called in the worker's main process after it killed the child at the hard limit."""
        store = self.platform.store
        try:
            with self.platform.engine.begin() as conn:
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
                    delay = spec.retry.delay(
                        counted_attempts(row),
                        default_base=self.platform.settings.backoff_base,
                        default_cap=self.platform.settings.backoff_cap,
                    )
                    store.schedule_retry(conn, row, attempt, delay, exc)
                    return
                burial = self.platform.bury(
                    conn,
                    row,
                    error=exc,
                    message=f"{spec.name} exceeded its hard time limit ({exc}) and was killed",
                    attempt=attempt,
                )
            self.platform.after_burial(burial)
        except Exception:
            log.warning(
                "could not record hard timeout of task %s; the reconciler will", task_id, exc_info=True
            )

    # -- adoption & skips ---------------------------------------------------------------

    def _adopt(
        self, conn: Any, spec: StageSpec, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """Create the row for a message published without one (``send_task`` by name).

        It goes through the same validation and deduplication as ``submit()``; a duplicate
        returns the holder's id, whose own message runs it (this copy is skipped).
        """
        options = {
            "chain": req.chain,
            "chord": req.chord,
            "link": req.callbacks,
            "link_error": req.errbacks,
            "group_id": req.group,
            "group_index": req.group_index,
            "parent_id": req.parent_id,
            "root_id": req.root_id,
        }
        new = NewJob(
            id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor:adopt:{req.id}")),
            stage=spec.name,
            queue=_queue_of(req, spec),
            payload={},
            max_attempts=spec.max_attempts,
            label=spec.name,
            origin_task_id=req.id,
            options={k: v for k, v in options.items() if v is not None},
        )
        # A deduplicated message that carries a flow (chain, callbacks, chord) follows the
        # holder, so what hangs off it runs with the holder's result.
        new.follow = has_flow(new.options)
        store = self.platform.store
        raw: Any = {}
        try:
            raw = payload_from_call(args, kwargs)
            payload = spec.validate(raw)
            data = self.platform.payload_of(spec, payload)
        except PayloadInvalid as exc:
            new.payload = kept_if_small(raw, exc)
            _, created = store.insert(conn, new)
            if created:
                store.emit(conn, [new_event(new.id, "job.adopted", {"stage": spec.name})])
                row = store.get(conn, new.id)
                assert row is not None
                store.dead_letter(
                    conn,
                    row,
                    error_type=type(exc).__name__,
                    message=str(exc),
                    tb_text=None,
                    from_status=(s.QUEUED,),
                )
            return new.id
        new.payload = data
        new.label = spec.label_for(payload)
        plan = self.platform.dedup_plan(spec, payload, None, "never")
        if plan is not None and store.get(conn, new.id) is not None:
            return new.id  # a redelivery of a message adopted before
        now = self.platform.deduper.clock() if plan is not None else 0.0
        if plan is not None:
            new.dedup_key = plan.dedup_id
            if plan.dedup.mode == "debounce":
                new.delay = float(plan.dedup.window or 0)
        job_id, created = self.platform._record(conn, new, plan, now, self.platform.broker.epoch())
        if created:
            store.emit(conn, [new_event(job_id, "job.adopted", {"stage": spec.name})])
        return job_id

    def _record_skip(self, job_id: str, outcome: ClaimOutcome, task_id: str) -> None:
        """A copy that must not run (a duplicate, or the job ended or is not due): no
        Postgres write, so duplicates under a backlog cost the database nothing. Counted
        in the metrics and noted in a capped Redis stream (``discarded_stream``)."""
        p = self.platform
        p.metrics.inc("skipped", "*")
        try:
            p.redis.xadd(
                p.discarded_stream,
                {"job": job_id, "reason": outcome.value, "task_id": task_id},
                maxlen=10_000,
                approximate=True,
            )
        except Exception:  # informational only: never fail the delivery for it
            log.warning("could not note the discarded copy of %s", job_id)

    def record_garbage(self, error_type: str, message: str, headers: Mapping[str, Any]) -> None:
        """DLQ entry for an unrunnable message; headers only, never the body."""
        safe = {
            k: _short(v)
            for k, v in headers.items()
            if k
            in (
                "id",
                "task",
                "lang",
                "root_id",
                "parent_id",
                "group",
                "retries",
                JOB_HEADER,
                "content_type",
                "content_encoding",
                "delivery_info",
                "origin",
            )
        }
        with self.platform.engine.begin() as conn:
            self.platform.store.record_garbage(conn, error_type=error_type, message=message, headers=safe)
        self.platform.metrics.inc("dead", "garbage")


def _header(req: Any, name: str) -> str | None:
    value = getattr(req, name, None)
    if value is None and isinstance(getattr(req, "headers", None), dict):
        value = req.headers.get(name)
    return str(value) if value else None


def _queue_of(req: Any, spec: StageSpec) -> str:
    info = getattr(req, "delivery_info", None) or {}
    return str(info.get("routing_key") or spec.queue)


def _short(value: Any) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return str(value)[:200]


def _readable(exc: BaseException, spec: StageSpec, attempt: int, max_attempts: int, exhausted: bool) -> str:
    text = describe(exc)
    if isinstance(exc, SoftTimeLimitExceeded):
        text = f"{spec.name} exceeded its soft time limit"
    if exhausted:
        return f"gave up after {attempt} of {max_attempts} attempts: {text}"[:2000]
    return text[:2000]


__all__ = ["Runner", "lease_owner"]
