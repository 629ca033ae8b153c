"""Continuations: the jobs a finished job's next chain link and link callbacks become.

Conveyor takes a stage's continuation over from Celery and inserts it in the finished
job's completion transaction, so a kill between the two can never strand a flow. Its ids
are fixed by the canvas, so computing them again (a redelivered copy) finds the same jobs;
a continuation that exists already belongs to a job completing again after a DLQ retry
and runs again with the new input. Publishing them after commit is
:meth:`conveyor.worker.flow.Flow.publish_continuations`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from celery import Signature, signature
from sqlalchemy import Connection

from conveyor import tracing
from conveyor.client.followers import Followers
from conveyor.client.recorder import Recorder
from conveyor.client.session_hooks import utc_or_none
from conveyor.dedup import DedupPlan
from conveyor.delivery.connections import Connections
from conveyor.errors import PayloadInvalid, describe
from conveyor.logs import redact_text
from conveyor.metrics import Metrics
from conveyor.stage import (
    JOB_IDS_ATTR,
    StageSpec,
    kept_if_small,
    payload_from_call,
    signature_options,
)
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob, Row, counted_attempts, format_traceback
from conveyor.wire import Record, from_wire


class Continuations:
    """Builds a finished job's continuation jobs and inserts them in its transaction."""

    def __init__(
        self,
        connections: Connections,
        *,
        stages: Stages,
        store: JobStore,
        recorder: Recorder,
        deduper: Deduplicator,
        followers: Followers,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.stages = stages
        self.store = store
        self.recorder = recorder
        self.deduper = deduper
        self.followers = followers
        self.metrics = metrics

    def continuation(
        self,
        sig: Signature,
        result: Any,
        parent: Row,
        extra: Mapping[str, Any],
        *,
        leading: tuple[Any, ...] | None = None,
        kind: str = "next",
        index: int = 0,
    ) -> NewJob:
        """The job a chain link or link callback becomes (an errback, with ``leading`` as
        its first arguments and ``kind="errback"``); its id is fixed by the canvas."""
        spec = self.stages.spec(sig.task)
        # A signature read back from a job's options carries kombu's tags (bytes...).
        args = tuple(_decoded(list(sig.args or ())))
        if not sig.immutable:
            # The result is stored in kombu's JSON: passed on as the value itself.
            args = (*(leading if leading is not None else (from_wire(result),)), *args)
        invalid: tuple[str, str] | None = None
        raw: Any = {}
        try:
            raw = payload_from_call(spec, args, _decoded(dict(sig.kwargs or {})))
            model = spec.validate(raw)
            payload = self.recorder.payload_of(spec, model)
        except PayloadInvalid as exc:
            # The parent's success stands; this link is dead-lettered with the reason.
            invalid, payload = (type(exc).__name__, str(exc)), kept_if_small(raw, exc)
        opts = dict(sig.options or {})
        task_id = opts.pop("task_id", None)
        # Two callbacks (or errbacks) of the same task are two jobs: the second one's place
        # is in its id (the first keeps the id it always had: a DLQ retry finds it again).
        place = f":{index}" if index else ""
        job_id = task_id or str(
            uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor:{kind}:{parent['id']}:{sig.task}{place}")
        )
        stored = signature_options(
            {**opts, **extra}, link=opts.get("link"), link_error=opts.get("link_error")
        )
        new = NewJob(
            id=job_id,
            stage=spec.name,
            queue=opts.get("queue") or spec.queue,
            payload=payload,
            max_attempts=spec.max_attempts,
            priority=spec.priority,
            label=spec.name.rsplit(".", 1)[-1] if invalid else spec.label_for(model),
            options=stored,
            origin_task_id=job_id,
            flow_id=parent["flow_id"],
            parent_id=parent["id"],
            owner=parent.get("owner"),  # a flow's next link stays its owner's
            invalid=invalid,
        )
        if invalid is None:
            # The same dedup decision as submit(); a canvas waits on this id, so a duplicate
            # becomes a follower of the holder rather than vanishing into it.
            new.plan = self.recorder.dedup_plan(spec, model, None, "never")
            new.follow = True
        return new

    def child(self, stage: str, payload: Mapping[str, Any], options: Mapping[str, Any]) -> NewJob:
        """The job a body's ``ctx.submit(stage, payload, **options)`` becomes, checked now
        (an unknown stage, an invalid payload or option raise in the body); its owner and
        the insert come at the completion (:meth:`insert`). ``options``: ``delay``,
        ``run_at``, ``priority``, ``label``, ``max_attempts``, ``dedup``, ``reuse``,
        ``idempotency_key``, ``job_id``, ``expires_in``."""
        unknown = sorted(set(options) - _CHILD_OPTIONS)
        if unknown:
            raise TypeError(f"ctx.submit() got unexpected option(s): {', '.join(unknown)}")
        spec = self.stages.spec(stage)
        model = spec.validate(payload)
        new = NewJob.submitted(
            stage=spec.name,
            queue=spec.queue,
            payload=self.recorder.payload_of(spec, model),
            max_attempts=options.get("max_attempts") or spec.max_attempts,
            priority=spec.priority if options.get("priority") is None else int(options["priority"]),
            label=options.get("label") or spec.label_for(model),
            idempotency_key=options.get("idempotency_key"),
            delay=float(options.get("delay") or 0.0),
            expires_in=options.get("expires_in"),
            run_at=utc_or_none(options.get("run_at")),
            job_id=options.get("job_id"),
        )
        new.plan = self.recorder.dedup_plan(spec, model, options.get("dedup"), options.get("reuse", "never"))
        return new

    def next_jobs(
        self,
        chain: Sequence[Any],
        callbacks: Sequence[Any],
        parent: Row,
        result: Any,
        extra: Mapping[str, Any],
    ) -> tuple[list[NewJob], bool, bool]:
        """The jobs a finished job's next chain link and link callbacks become.

        Returns them and whether the chain and the callbacks were taken over (they are
        stages); links to plain tasks stay with Celery.
        """
        app = self.connections.app
        created: list[NewJob] = []
        took_chain = took_callbacks = False
        if chain:
            nxt = signature(chain[-1], app=app)
            if nxt.task in self.stages:
                created.append(
                    self.continuation(nxt, result, parent, {**extra, "chain": list(chain[:-1]) or None})
                )
                took_chain = True
        sigs = [signature(c, app=app) for c in callbacks]
        if sigs and all(cb.task in self.stages for cb in sigs):
            created += [self.continuation(cb, result, parent, extra, index=i) for i, cb in enumerate(sigs)]
            took_callbacks = True
        return created, took_chain, took_callbacks

    def take_over(self, conn: Connection, request: Any, job: Row, result: Any) -> list[NewJob]:
        """Create the continuation of the delivery ``request`` in its completion transaction.

        Celery would publish it right after the body returns; doing it here makes the
        continuation commit atomically with the completion. What is taken over (stages) is
        cleared from the request; links to plain tasks stay with Celery. Returns the jobs to
        publish after commit.
        """
        own = task_id_of(job)  # the job's task id, whichever message carried it
        extra = {"parent_id": own, "root_id": request.root_id or own}
        created, took_chain, took_callbacks = self.next_jobs(
            list(request.chain or []), list(request.callbacks or []), job, result, extra
        )
        if took_chain:
            request.chain = None
        if took_callbacks:
            request.callbacks = None
        return self.insert(conn, created, upstream=str(job["id"]))

    def take_errbacks(self, conn: Connection, request: Any, job: Row, error: BaseException) -> list[NewJob]:
        """In a dead-letter transaction: the jobs the delivery's stage errbacks become
        (:meth:`errback_jobs`), cleared from the request so Celery does not call them too.
        Returns the jobs to publish after commit."""
        errbacks = list(request.errbacks or [])
        created, rest = self.errback_jobs(errbacks, job, error)
        request.errbacks = rest or None
        return self.insert(conn, created, upstream=str(job["id"]))

    def errback_jobs(
        self, errbacks: Sequence[Any], job: Row, error: BaseException
    ) -> tuple[list[NewJob], list[Any]]:
        """The jobs a dead job's ``link_error`` stages become, called as Celery calls an
        errback, and the errbacks that are no stages (left to Celery).

        Celery calls an errback whose function takes ``*args`` or more than one positional
        argument still free (not given by its signature) with ``(request, exc, traceback)``,
        and one declared with ``bind=True`` or taking fewer with ``(task_id)``; a stage's
        arguments are its payload's fields. ``request`` holds the
        failed task's ``id``, ``task``, ``args``, ``kwargs``, ``parent_id``, ``root_id``,
        ``group``, ``group_index`` and ``retries``, ``exc`` its ``type`` and ``message``,
        both a :class:`conveyor.stage.Record` (keys are attributes too, ``request.id``);
        ``traceback`` is its text (scrubbed as the DLQ's are).
        """
        app = self.connections.app
        sigs = [signature(e, app=app) for e in errbacks]
        own = task_id_of(job)
        options = job["options"] or {}
        extra = {"parent_id": own, "root_id": options.get("root_id") or own}
        created: list[NewJob] = []
        rest: list[Any] = []
        for index, (sig, raw) in enumerate(zip(sigs, errbacks, strict=True)):
            if sig.task not in self.stages:
                rest.append(raw)
                continue
            spec = self.stages.spec(sig.task)
            leading: tuple[Any, ...] = (own,)
            if _new_style(spec, sig):
                leading = (_request_of(job, own, extra["root_id"]), _exc_of(error), _traceback_of(error))
            created.append(
                self.continuation(sig, None, job, extra, leading=leading, kind="errback", index=index)
            )
        return created, rest

    def insert(self, conn: Connection, created: Sequence[NewJob], *, upstream: str) -> list[NewJob]:
        """Insert a completion's continuation jobs in its transaction.

        A continuation that exists already belongs to an upstream job completing again
        after a DLQ retry: it runs again with the new input (``rerun``), so a flow resumes
        from the failed stage. Returns the jobs to publish after commit.
        """
        out: list[NewJob] = []
        if not created:
            return out
        epoch = self.connections.broker.epoch()
        for new in created:
            # The next link's submit, a child of the completion: the whole flow is one trace.
            attributes = {"conveyor.stage": new.stage, "conveyor.job_id": new.id}
            with tracing.span("conveyor.submit", attributes={**attributes, "conveyor.upstream": upstream}):
                new.trace_context = tracing.carrier()
                self._insert_one(conn, new, epoch, upstream, out)
        return out

    def _insert_one(
        self, conn: Connection, new: NewJob, epoch: str, upstream: str, out: list[NewJob]
    ) -> None:
        """Insert (or rerun) one continuation; appends it to ``out`` if it is to be published."""
        plan: DedupPlan | None = new.plan
        if new.invalid is not None:
            if self._insert_dead(conn, new):
                out.append(new)
            return
        if plan is None:
            inserted = self.recorder.insert_job(conn, new, epoch=epoch)
        else:
            now = self.deduper.clock()
            new.dedup_key = plan.dedup_id
            if plan.dedup.mode == "debounce":
                new.delay = max(new.delay, float(plan.dedup.window or 0))
            job_id, inserted = self.recorder.record(conn, new, plan, now, epoch)
            inserted = inserted and job_id == new.id
        if inserted:
            out.append(new)
            return
        spec = self.stages.get(new.stage)
        budget = spec.max_attempts if spec else self.connections.settings.default_max_attempts
        if self.store.rerun(conn, new, budget=budget, upstream=upstream):
            holder = None
            if plan is not None:
                now = self.deduper.clock()
                holder = self.deduper.retake(conn, plan.dedup_id, new.id, now=now, mode=plan.dedup.mode)
            if holder is not None:
                self.followers.convert(conn, new.id, holder)
                new.status, new.follows = s.WAITING_DEDUP, holder
            else:
                new.rerun = True
            out.append(new)

    def _insert_dead(self, conn: Connection, new: NewJob) -> bool:
        """Store a job that can never run (its payload is invalid) straight into the DLQ;
        False if it existed already."""
        assert new.invalid is not None
        if not self.store.insert(conn, new)[1]:
            return False
        row = self.store.get(conn, new.id)
        assert row is not None
        error_type, message = new.invalid
        self.store.dead_letter(
            conn, row, error_type=error_type, message=message, tb_text=None, from_status=(s.QUEUED,)
        )
        self.metrics.inc("dead", new.stage)
        new.status = s.DEAD
        return True


_CHILD_OPTIONS = frozenset(
    (
        "delay",
        "run_at",
        "priority",
        "label",
        "max_attempts",
        "dedup",
        "reuse",
        "idempotency_key",
        "job_id",
        "expires_in",
    )
)


def task_id_of(job: Row) -> str:
    """The task id of ``job`` as its canvas knows it: the job's id, the first message's
    (a retry or a republish carries the job in a message of another id)."""
    return str(job.get("origin_task_id") or job["id"])


@contextmanager
def seen_as_job(request: Any, job: Row) -> Iterator[None]:
    """Mark a stage's delivery ``request`` with its job's task id for the whole delivery
    (:data:`conveyor.stage.JOB_IDS_ATTR`), and while the body runs show it as the request's
    ``id`` (and its root's, for a job that is its own root) and its counted attempts before
    this one as ``retries``: a retry or a republish carries
    the job in a message of another id, and the body sees the task id its canvas knows.
    Celery's own bookkeeping after the body (the result, chord counting) keeps the
    message's id."""
    own = task_id_of(job)
    message_id, message_root, message_retries = request.id, request.root_id, request.retries
    setattr(request, JOB_IDS_ATTR, (message_id, own))
    request.id = own
    if message_root in (None, message_id):
        request.root_id = own
    # Celery counts a task's retries in its message; a job's are its counted attempts.
    request.retries = max(0, counted_attempts(job) - 1)
    try:
        yield
    finally:
        request.id, request.root_id, request.retries = message_id, message_root, message_retries


def _decoded(value: Any) -> Any:
    """Stored arguments back to their values (kombu's tags decoded); a request's are already."""
    try:
        return from_wire(value)
    except TypeError:  # bytes and the like: not JSON, so not stored ones
        return value


def _new_style(spec: StageSpec, sig: Any) -> bool:
    """Celery's rule (``Backend._call_task_errbacks``): a bound task's header is a partial,
    which always makes it old style; else ``*args`` or two free positional arguments."""
    if spec.bound:
        return False
    if spec.var_positional is not None:
        return True
    given = dict(sig.kwargs or {})
    free = [f for f in spec.positional_fields if f not in given]
    return len(free[len(sig.args or ()) :]) > 1


def _request_of(job: Row, own: str, root_id: str) -> Record:
    """What an errback's ``request`` carries of the failed job."""
    options = job["options"] or {}
    return Record(
        {
            "id": own,
            "task": job["stage"],
            "args": [],
            "kwargs": from_wire(dict(job["payload"] or {})),
            "parent_id": options.get("parent_id"),
            "root_id": root_id,
            "group": options.get("group_id"),
            "group_index": options.get("group_index"),
            "retries": max(0, counted_attempts(job) - 1),
        }
    )


def _exc_of(error: BaseException) -> Record:
    return Record({"type": type(error).__name__, "message": redact_text(describe(error))[:2000]})


def _traceback_of(error: BaseException) -> str:
    return redact_text(format_traceback(error))


__all__ = ["Continuations", "seen_as_job", "task_id_of"]
