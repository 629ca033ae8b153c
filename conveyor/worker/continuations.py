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
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Signature, signature
from sqlalchemy import Connection

from conveyor import tracing
from conveyor.client.followers import Followers
from conveyor.client.recorder import Recorder
from conveyor.dedup import DedupPlan
from conveyor.delivery.connections import Connections
from conveyor.errors import PayloadInvalid
from conveyor.metrics import Metrics
from conveyor.stage import from_wire, kept_if_small, payload_from_call, signature_options
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob, Row


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

    def continuation(self, sig: Signature, result: Any, parent: Row, extra: Mapping[str, Any]) -> NewJob:
        """The job a chain link or link callback becomes; its id is fixed by the canvas."""
        spec = self.stages.spec(sig.task)
        args = tuple(sig.args or ())
        if not sig.immutable:
            args = (from_wire(result), *args)  # stored in kombu's JSON: the value itself
        invalid: tuple[str, str] | None = None
        raw: Any = {}
        try:
            raw = payload_from_call(spec, args, dict(sig.kwargs or {}))
            model = spec.validate(raw)
            payload = self.recorder.payload_of(spec, model)
        except PayloadInvalid as exc:
            # The parent's success stands; this link is dead-lettered with the reason.
            invalid, payload = (type(exc).__name__, str(exc)), kept_if_small(raw, exc)
        opts = dict(sig.options or {})
        task_id = opts.pop("task_id", None)
        job_id = task_id or str(uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor:next:{parent['id']}:{sig.task}"))
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
            created += [self.continuation(cb, result, parent, extra) for cb in sigs]
            took_callbacks = True
        return created, took_chain, took_callbacks

    def take_over(self, conn: Connection, request: Any, job: Row, result: Any) -> list[NewJob]:
        """Create the continuation of the delivery ``request`` in its completion transaction.

        Celery would publish it right after the body returns; doing it here makes the
        continuation commit atomically with the completion. What is taken over (stages) is
        cleared from the request; links to plain tasks stay with Celery. Returns the jobs to
        publish after commit.
        """
        extra = {"parent_id": request.id, "root_id": request.root_id or request.id}
        created, took_chain, took_callbacks = self.next_jobs(
            list(request.chain or []), list(request.callbacks or []), job, result, extra
        )
        if took_chain:
            request.chain = None
        if took_callbacks:
            request.callbacks = None
        return self.insert(conn, created, upstream=str(job["id"]))

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


__all__ = ["Continuations"]
