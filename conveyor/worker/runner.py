"""The stage lifecycle inside a worker: claim → body → one completion transaction.

The runner claims the delivered message's job, runs the body beside its heartbeat and
hands the outcome to :class:`conveyor.worker.completion.Completion`; what follows a job's end
(continuations, followers, burials) is :class:`conveyor.worker.flow.Flow`'s. Each of them calls
down (store, leases, dedup, broker), never back up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject

from conveyor import tracing
from conveyor.client.recorder import Recorder
from conveyor.client.stops import Stops
from conveyor.delivery.broker import JOB_HEADER
from conveyor.delivery.connections import Connections
from conveyor.errors import (
    Cancelled,
    Deferred,
    Interrupted,
    PayloadInvalid,
    SkipJob,
    TaskIdRefused,
    is_connection_loss,
    is_own_outage,
    is_stopped_by_worker,
)
from conveyor.metrics import Metrics
from conveyor.runfile import lease_owner
from conveyor.shared import job_scope
from conveyor.stage import StageSpec, kept_if_small, payload_from_call, to_jsonable
from conveyor.store.db import schema as s
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import Claim, ClaimOutcome, JobStore, NewJob, Row, counted_attempts, new_event
from conveyor.wire import from_wire
from conveyor.worker.admission import Slot
from conveyor.worker.completion import Completion
from conveyor.worker.context import ContextServices, JobContext
from conveyor.worker.continuations import seen_as_job
from conveyor.worker.flow import Flow
from conveyor.worker.gate import Gate, queue_of
from conveyor.worker.heartbeat import Heartbeat
from conveyor.worker.leases import Leases

log = logging.getLogger("conveyor.runner")


class Runner:
    """Runs one delivered message of a stage through the job lifecycle."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        recorder: Recorder,
        deduper: Deduplicator,
        stops: Stops,
        leases: Leases,
        gate: Gate,
        heartbeat: Heartbeat,
        completion: Completion,
        flow: Flow,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.store = store
        self.recorder = recorder
        self.deduper = deduper
        self.stops = stops
        self.leases = leases
        self.gate = gate
        self.heartbeat = heartbeat
        self.completion = completion
        self.flow = flow
        self.metrics = metrics
        self.context_services = ContextServices(connections, store, stops, completion.continuations)
        self.queue_names = frozenset(q.name for q in connections.queues)
        # Copies of jobs that were not run (duplicates, ended, not due): job, reason, task id.
        self.discarded_stream = f"{connections.settings.key_prefix}discarded"

    # -- entry points -------------------------------------------------------------------

    def run_inline(self, spec: StageSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A direct function call (``stage(...)``): validate and run, no job row."""
        payload = spec.validate(payload_from_call(spec, args, kwargs))
        ctx = JobContext(self.context_services, job_id="inline", attempt=1, stage=spec.name, flow_id=None)
        try:
            with job_scope(ctx):
                return from_wire(to_jsonable(spec.fn(ctx, payload)))
        finally:
            ctx.close()

    def execute(self, task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Claim the job of this delivery and run it; see the class docs of the outcomes."""
        spec = task.spec
        req = task.request
        store = self.store
        owner = lease_owner()
        slot = None
        refused: PayloadInvalid | None = None
        started = tracing.now_ns()
        tracing.clear_job_context()
        try:
            job_id = _header(req, JOB_HEADER)
            if job_id is not None:
                slot = self.gate.admit(spec, req, job_id)
            claim: Claim | None = None
            lane = self.connections.lane
            if job_id is not None and lane is not None:
                # The common case in one round trip; None: the full claim says why.
                row = lane.claim(job_id, owner=owner, task_id=req.id)
                claim = Claim(ClaimOutcome.RUN, row) if row is not None else None
            if claim is None:
                with self.connections.engine.begin() as conn:
                    if job_id is None:
                        job_id, refused = self._adopt(conn, spec, req, args, kwargs)
                    claim = store.claim(conn, job_id, owner=owner, task_id=req.id)
                    if claim.took_over and claim.job is not None:
                        self.flow.record_stalled(conn, claim.job, int(claim.job["attempts"]) - 1)
        except TaskIdRefused as exc:
            try:
                self.record_garbage(type(exc).__name__, str(exc), _headers_of(req))
            except Exception:  # the error still reaches the caller (or the log) below
                log.warning("could not record a refused task id in the DLQ", exc_info=True)
            if exc.taken_by is not None:
                raise Ignore() from None  # a failure stored now would overwrite that job's outcome
            raise  # Celery stores it under this task id: the caller's get() raises it
        except Exception as exc:
            if not is_connection_loss(exc):
                raise
            self.gate.give_back(slot)
            log.warning("infrastructure error before claim (%s); requeueing", type(exc).__name__)
            time.sleep(self.connections.settings.infra_backoff)
            raise Reject(exc, requeue=True) from None

        if refused is not None:
            # Dead-lettered at adoption: the caller's AsyncResult hears of it as of a task
            # that raised (Celery stores the failure under this task id, the job's id).
            assert job_id is not None
            self.metrics.inc("dead", spec.name)
            self.flow.finished(job_id, s.DEAD)
            raise refused
        job = claim.job
        if job is not None:
            tracing.record_claim(spec.name, job["id"], job.get("trace_context"), started, claim.outcome.value)
        if claim.outcome is ClaimOutcome.RUN:
            assert job is not None
            self.metrics.inc("claimed", spec.name)
            return self._run(task, spec, job, slot)
        self.gate.give_back(slot)
        if claim.outcome in (ClaimOutcome.WORKER_LOST, ClaimOutcome.REQUEUES_EXHAUSTED):
            assert job is not None
            self.flow.bury_lost(job, requeues=claim.outcome is ClaimOutcome.REQUEUES_EXHAUSTED)
            raise Ignore()
        if claim.outcome is ClaimOutcome.ALREADY_SUCCEEDED:
            assert job is not None
            return self._replay_success(task, job)
        assert job_id is not None
        if claim.outcome is ClaimOutcome.MISSING:
            settings = self.connections.settings
            # A submit publishes only a row it saw committed, and the relay only rows it
            # read: the submitter's database is not this one, or its client predates that.
            log.warning(
                "job %s of %s has no row in this worker's database (schema %s): its message was "
                "dropped here. The job's row never committed in this database: it was recorded "
                "in another database or schema (one Redis database must serve one Conveyor "
                "database and schema), or by an older client whose submit rolled back after "
                "publishing",
                job_id, spec.name, settings.db_schema,
            )  # fmt: skip
        self._record_skip(job_id, claim.outcome, req.id)
        if claim.outcome is ClaimOutcome.TERMINAL and job is not None:
            self.flow.finished(job_id, job["status"], dedup_key=job["dedup_key"])
        raise Ignore()

    # -- running ------------------------------------------------------------------------

    def _run(self, task: Task, spec: StageSpec, job: Row, slot: Slot | None = None) -> Any:
        """The body and its completion inside a ``conveyor.run <stage>`` span, a child of the
        job row's context (not the message's: a republished copy joins the same trace)."""
        parent = tracing.run_parent(job.get("trace_context"))
        attributes = {"conveyor.job_id": job["id"], "conveyor.attempt": int(job["attempts"])}
        with tracing.span(f"conveyor.run {spec.name}", parent=parent, attributes=attributes) as span:
            tracing.set_job_context()  # a chord body fired after this span still joins it
            try:
                return self._run_body(task, spec, job, slot)
            except (Ignore, Reject):
                raise
            except BaseException as exc:
                tracing.failed(span, exc)
                raise

    def _run_body(self, task: Task, spec: StageSpec, job: Row, slot: Slot | None) -> Any:
        self.heartbeat.install_interrupt_handler()
        attempt = int(job["attempts"])
        ctx = JobContext(
            self.context_services,
            job_id=job["id"],
            attempt=attempt,
            stage=spec.name,
            flow_id=job["flow_id"],
            queue=job["queue"],
            owner=job["owner"],
            final_attempt=counted_attempts(job) >= int(job["max_attempts"]),
        )
        ctx.slot = slot
        self.heartbeat.track(ctx)
        started = time.monotonic()
        try:
            payload = spec.validate(from_wire(job["payload"]))
            if spec.lease_key:
                ctx.held = self.leases.take(ctx.job_id, ctx.attempt, spec, payload)
            with job_scope(ctx), seen_as_job(task.request, job):
                result = to_jsonable(spec.fn(ctx, payload))
            ctx.checkpoint(fresh=False)  # the body is done: the polled flag is enough
            self.completion.complete(task, spec, job, ctx, result)
            self.metrics.observe_runtime(spec.name, time.monotonic() - started)
            return from_wire(result)  # Celery's result backend carries it in kombu's JSON
        except (Ignore, Reject):
            raise
        except Deferred as deferral:
            ctx.close()
            carried = self.completion.defer(task, spec, job, attempt, deferral)
            return None if carried is None else carried[0]
        except SkipJob as skip:
            result = to_jsonable(skip.result)
            self.completion.complete(task, spec, job, ctx, result, skipped=skip.reason)
            self.metrics.observe_runtime(spec.name, time.monotonic() - started)
            return from_wire(result)
        except Interrupted as exc:
            ctx.close()
            if ctx.held is not None:
                # Hand the lease over first: the preemptor waiting for it should not wait
                # for this job's requeue transaction too (it is reserved for the preemptor).
                self.leases.release(ctx.held, ctx.job_id)
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
                self.heartbeat.requeue_uncounted(job["id"], attempt, lease_owner(), "worker_stopped")
                raise
            if is_own_outage(exc, redis_answers=self.connections.redis_answers):
                # Conveyor's own database or Redis failed the attempt (a body's own server
                # failing is the body's error): requeue it uncounted, due after the growing
                # back-off; while the database is out of reach, through the broker.
                log.warning("infrastructure error in %s (%s); requeueing", spec.name, type(exc).__name__)
                job_id, owner = job["id"], lease_owner()
                if self.heartbeat.requeue_uncounted(job_id, attempt, owner, "infrastructure") != "deferred":
                    raise Ignore() from None
                time.sleep(self.connections.settings.infra_backoff)
                raise Reject(exc, requeue=True) from None
            self.metrics.observe_runtime(spec.name, time.monotonic() - started, "err")
            carried_on = self.completion.fail(task, spec, job, attempt, exc)
            if carried_on is not None:
                return carried_on[0]
            raise
        finally:
            self.heartbeat.track(None)
            ctx.close()
            self.gate.release(slot)
            if ctx.held is not None:
                self.leases.release(ctx.held, ctx.job_id)

    def _interrupted(self, spec: StageSpec, job: Row, attempt: int, exc: Interrupted) -> None:
        """A checkpoint (or the escalation signal) stopped the body."""
        owner = lease_owner()
        cancelled = isinstance(exc, Cancelled)
        with self.connections.engine.begin() as conn:
            if cancelled:
                done = self.store.finish(
                    conn,
                    job,
                    s.CANCELLED,
                    from_status=(s.RUNNING,),
                    attempt=attempt,
                    topic="job.cancelled",
                    body={"while": "running"},
                )
            else:
                outcome = self.store.release_uncounted(
                    conn, job["id"], attempt, owner, "preempted", topic="job.preempted", requeue=False
                )
                done = outcome == "released"
        self.stops.clear_flag(job["id"])
        if not done:  # fenced off: a newer attempt owns the job; nothing was written
            log.info("job %s attempt %s was stopped but no longer owns the job", job["id"], attempt)
            return
        self.metrics.inc("cancelled" if cancelled else "preempted", spec.name)
        if cancelled:
            self.flow.finished(job["id"], s.CANCELLED, dedup_key=job["dedup_key"])

    def _replay_success(self, task: Task, job: Row) -> Any:
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
            self.flow.count_in_chord(job, "SUCCESS", job["result"])
            raise Ignore()
        return from_wire(job["result"])

    # -- adoption & skips ---------------------------------------------------------------

    def _adopt(
        self, conn: Any, spec: StageSpec, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, PayloadInvalid | None]:
        """Create the row for a message published without one (``send_task`` by name).

        The job's id is the message's task id, so the caller finds its job, and its
        ``AsyncResult`` is stored under it. A task id seen before is the same job (a
        redelivery, or a caller reusing the id), whatever the payload. The message goes
        through the same validation and deduplication as ``submit()``; a duplicate of a
        live holder follows it (its caller waits on this id). Returns the job id and, for
        a payload refused here (the job is dead-lettered at once), the error.
        """
        task_id = str(req.id)
        if len(task_id) > s.JOB_ID_LENGTH:
            raise TaskIdRefused(
                f"task id {task_id[:80]!r} is {len(task_id)} characters long: a task sent without a "
                f"job becomes the job of that id, at most {s.JOB_ID_LENGTH} characters (send it with "
                "a shorter task_id, or none: Celery makes a UUID)"
            )
        store = self.store
        existing = store.get(conn, task_id)
        if existing is not None:
            if existing["stage"] != spec.name:
                raise TaskIdRefused(
                    f"task id {task_id!r} is already the id of a job of stage {existing['stage']}: "
                    f"this {spec.name} message was not run; send it with a new task id",
                    taken_by=str(existing["stage"]),
                )
            return task_id, None
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
            id=task_id,
            stage=spec.name,
            queue=queue_of(req, spec, self.queue_names),
            payload={},
            max_attempts=spec.max_attempts,
            label=spec.name,
            origin_task_id=task_id,
            options={k: v for k, v in options.items() if v is not None},
        )
        # The caller holds an AsyncResult of this task id: a duplicate follows the holder
        # and takes its outcome, as a call with a canvas-fixed task id does.
        new.follow = True
        raw: Any = {}
        try:
            raw = payload_from_call(spec, args, kwargs)
            payload = spec.validate(raw)
            data = self.recorder.payload_of(spec, payload)
        except PayloadInvalid as exc:
            new.payload = kept_if_small(raw, exc)
            _, created = store.insert(conn, new)
            if not created:
                return new.id, None  # a copy adopted it a moment ago
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
            return new.id, exc
        new.payload = data
        new.label = spec.label_for(payload)
        plan = self.recorder.dedup_plan(spec, payload, None, "never")
        now = self.deduper.clock() if plan is not None else 0.0
        if plan is not None:
            new.dedup_key = plan.dedup_id
            if plan.dedup.mode == "debounce":
                new.delay = float(plan.dedup.window or 0)
        job_id, created = self.recorder.record(conn, new, plan, now, self.connections.broker.epoch())
        if created:
            store.emit(conn, [new_event(job_id, "job.adopted", {"stage": spec.name})])
        return job_id, None

    def _record_skip(self, job_id: str, outcome: ClaimOutcome, task_id: str) -> None:
        """A copy that must not run (a duplicate, or the job ended or is not due): no
        Postgres write, so duplicates under a backlog cost the database nothing. Counted
        in the metrics and noted in a capped Redis stream (``discarded_stream``)."""
        self.metrics.inc("skipped", "*")
        try:
            self.connections.redis.xadd(
                self.discarded_stream,
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
        with self.connections.engine.begin() as conn:
            self.store.record_garbage(conn, error_type=error_type, message=message, headers=safe)
        self.metrics.inc("dead", "garbage")


def _header(req: Any, name: str) -> str | None:
    value = getattr(req, name, None)
    if value is None and isinstance(getattr(req, "headers", None), dict):
        value = req.headers.get(name)
    return str(value) if value else None


def _headers_of(req: Any) -> dict[str, Any]:
    """What a DLQ entry keeps of a delivery: its headers, never its body."""
    names = ("id", "task", "root_id", "parent_id", "group", "retries", "delivery_info")
    return {name: getattr(req, name, None) for name in names}


def _short(value: Any) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return str(value)[:200]


__all__ = ["Runner", "lease_owner"]
