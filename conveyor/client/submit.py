"""Submitting jobs: ``submit()``, ``delay()``/``apply_async()``/canvases, and the caller's
transaction.

A submit validates the payload against its stage's model, records the job (deduplicated,
:mod:`conveyor.client.recorder`) in the caller's transaction when given one, else in its own,
and publishes it once that committed. A duplicate never raises: it returns the holder's
handle.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from celery import Task
from kombu.entity import Queue
from opentelemetry.trace import SpanKind
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, scoped_session

from conveyor import tracing
from conveyor.client import session_hooks
from conveyor.client.bulk import DEFAULT_BATCH_SIZE, BulkItem, BulkSubmit, check_keys, indexed_invalid
from conveyor.client.enlist import Enlistment
from conveyor.client.followers import Settles, has_flow
from conveyor.client.handle import JobHandle
from conveyor.client.idempotency import Strict
from conveyor.client.owners import owned_key
from conveyor.client.recorder import Recorder
from conveyor.client.session_hooks import resolved, utc_or_none
from conveyor.client.stops import Stops
from conveyor.dedup import Dedup, DedupPlan, Reuse
from conveyor.delivery.connections import Connections
from conveyor.errors import ConfigurationError, PayloadInvalid, SubmitFailed, describe, is_connection_loss
from conveyor.metrics import Metrics
from conveyor.stage import StageSpec, check_call_limits, lineage, payload_from_call, signature_options
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.db.namespace import use_schema
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob

log = logging.getLogger("conveyor.submit")


class Submitter:
    """Records jobs for callers and publishes them after commit."""

    def __init__(
        self,
        connections: Connections,
        *,
        stages: Stages,
        store: JobStore,
        recorder: Recorder,
        deduper: Deduplicator,
        stops: Stops,
        settle: Settles,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.stages = stages
        self.store = store
        self.recorder = recorder
        self.deduper = deduper
        self.stops = stops
        self.settle = settle
        self.metrics = metrics
        self._local = threading.local()
        self._strict: dict[str, Strict] = {}

    def handle(self, job_id: str, *, deduplicated: bool = False, task_id: str | None = None) -> JobHandle:
        """A handle on job ``job_id``."""
        return JobHandle(
            job_id,
            connections=self.connections,
            store=self.store,
            cancel=self.stops.cancel,
            deduplicated=deduplicated,
            task_id=task_id,
        )

    def submit(
        self,
        stage: str | Task | StageSpec,
        payload: BaseModel | Mapping[str, Any] | None = None,
        *,
        session: Session | scoped_session[Any] | Enlistment | None = None,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        run_at: dt.datetime | None = None,
        expires_in: float | None = None,
        priority: int | None = None,
        label: str | None = None,
        max_attempts: int | None = None,
        dedup: Dedup | Literal[False] | None = None,
        reuse: Reuse = "never",
        owner: str | None = None,
        job_id: str | None = None,
    ) -> JobHandle:
        """Record a job and publish it after commit. Returns a :class:`JobHandle`.

        With ``session`` (a ``Session``, or a ``scoped_session`` such as Flask-SQLAlchemy's
        ``db.session``, resolved to its current session) the job joins the caller's
        transaction: it is published only if and when that transaction commits. An
        ``idempotency_key`` seen before returns the existing job (any state) with
        ``deduplicated=True``. ``dedup`` overrides the stage's declared policy (``False``
        turns it off); ``reuse`` applies to deterministic ids. A duplicate never raises:
        it returns the holder's handle. ``owner`` is recorded with the job (who may see it
        over HTTP); it scopes ``idempotency_key`` to that owner (:mod:`conveyor.client.owners`).
        ``job_id`` (1-36 letters, digits, ``-_.``) is the job's id: a job of that id already
        recorded is returned (any state) with ``deduplicated=True``. A stage declared
        ``idempotency="strict"`` raises :class:`conveyor.errors.IdempotencyConflict` instead
        when that job (or the key's) is another stage's or holds another payload.
        """
        key = owned_key(owner, idempotency_key)
        spec = self.stages.spec(stage)
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload or {})
        model = spec.validate(data)
        new = NewJob.submitted(
            stage=spec.name,
            queue=spec.queue,
            payload=self.recorder.payload_of(spec, model),
            max_attempts=max_attempts or spec.max_attempts,
            priority=spec.priority if priority is None else priority,
            label=label or spec.label_for(model),
            idempotency_key=key,
            owner=owner,
            delay=delay,
            expires_in=expires_in,
            run_at=utc_or_none(run_at),
            job_id=job_id,
        )
        plan = self.recorder.dedup_plan(spec, model, dedup, reuse)
        return self.enqueue(new, session=session, plan=plan, strict=self.strict_rule(spec))

    def strict_rule(self, spec: StageSpec) -> Strict | None:
        """``spec``'s strict idempotency rule, or None for a stage without one."""
        if spec.idempotency != "strict":
            return None
        rule = self._strict.get(spec.name)
        if rule is None:
            schema = spec.payload.model_json_schema(mode="serialization")
            rule = self._strict[spec.name] = Strict.of(spec.name, spec.idempotency_ignore, schema)
        return rule

    def submit_many(
        self,
        stage: str | Task | StageSpec,
        payloads: Sequence[BaseModel | Mapping[str, Any] | None],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        owner: str | None = None,
        delay: float = 0.0,
        priority: int | None = None,
        max_attempts: int | None = None,
        dedup: Dedup | Literal[False] | None = None,
        reuse: Reuse = "never",
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> list[JobHandle]:
        """Record many jobs of one stage and publish them; their handles, in order.

        Each job is the one :meth:`submit` would record with the same options (one
        ``idempotency_keys`` entry per payload, or None). Every payload is validated first:
        an invalid one raises :class:`conveyor.errors.PayloadInvalid` naming its index, and
        nothing is recorded. The jobs are committed ``batch_size`` at a time, each batch
        one transaction published through one pipelined Redis call once it committed; when
        this returns every job is in the database. A key seen before, or earlier in the
        call, returns the holder's handle with ``deduplicated=True``. A stage with a dedup
        policy (or ``dedup``) records its jobs one by one through :meth:`submit`'s own
        path, so dedup answers exactly as there (:mod:`conveyor.client.bulk`).
        """
        spec = self.stages.spec(stage)
        keys = check_keys(len(payloads), idempotency_keys)
        items = []
        for i, (payload, key) in enumerate(zip(payloads, keys, strict=True)):
            try:
                data = (
                    payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload or {})
                )
                model = spec.validate(data)
                stored = self.recorder.payload_of(spec, model)
            except PayloadInvalid as exc:
                raise indexed_invalid(i, exc) from exc
            new = NewJob.submitted(
                stage=spec.name,
                queue=spec.queue,
                payload=stored,
                max_attempts=max_attempts or spec.max_attempts,
                priority=spec.priority if priority is None else priority,
                label=spec.label_for(model),
                idempotency_key=owned_key(owner, key),
                owner=owner,
                delay=delay,
            )
            items.append(BulkItem(new, self.recorder.dedup_plan(spec, model, dedup, reuse)))
        return BulkSubmit(self).run(items, batch_size=batch_size)

    def submit_call(
        self,
        spec: StageSpec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        task_id: str | None,
        link: Any,
        link_error: Any,
        options: Mapping[str, Any],
    ) -> JobHandle:
        """``apply_async``/``delay``/canvas path: same validation and row as :meth:`submit`."""
        if spec.preemptable and (options.get("chord") or options.get("group_id")):
            # A preempted member would be requeued outside its group's counter.
            raise ConfigurationError(
                f"stage {spec.name} is preemptable and cannot be a chord or group member"
            )
        model = spec.validate(payload_from_call(spec, args, kwargs))
        check_call_limits(spec, options)
        # Relative times count on the database's clock; absolute ones are stored as given.
        delay = float(options.get("countdown") or 0.0)
        eta = options.get("eta")
        expires = options.get("expires")
        expires_in = float(expires) if isinstance(expires, (int, float)) else None
        job_id = task_id or str(uuid.uuid4())
        parent_id, root_id = lineage(self.connections.app, options, job_id)
        # A job that is its own root stores none: its messages say so (broker.publish).
        lineage_ids = {"parent_id": parent_id, "root_id": root_id if root_id != job_id else None}
        stored = signature_options({**options, **lineage_ids}, link=link, link_error=link_error)
        if delay > 0 or eta is not None:
            # The messages say when the job was due, as Celery's say (``request.eta``).
            due = utc_or_none(eta) or dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
            stored["eta"] = due.isoformat()
        new = NewJob(
            id=job_id,
            stage=spec.name,
            queue=options.get("queue") or spec.queue,
            payload=self.recorder.payload_of(spec, model),
            max_attempts=spec.max_attempts,
            priority=spec.priority if options.get("priority") is None else int(options["priority"]),
            label=spec.label_for(model),
            delay=max(0.0, delay),
            expires_in=expires_in,
            run_at=utc_or_none(eta),
            expires_at=utc_or_none(expires) if not isinstance(expires, (int, float)) else None,
            options=stored,
            origin_task_id=job_id,
            # The options carry any parent's id; the column, a job's (a plain task's may be longer).
            parent_id=parent_id if parent_id and len(parent_id) <= s.JOB_ID_LENGTH else None,
        )
        if isinstance(new.queue, Queue):
            new.queue = new.queue.name
        new.follow = has_flow(stored) or task_id is not None
        session = getattr(self._local, "session", None)
        plan = self.recorder.dedup_plan(spec, model, None, "never")
        return self.enqueue(new, session=session, plan=plan)

    @contextmanager
    def enlisted(self, session: Session | scoped_session[Any]) -> Iterator[Session]:
        """Make ``delay()``/``apply_async()``/canvases inside the block join ``session``:
        their jobs commit with the caller's own changes and are published after commit."""
        previous = getattr(self._local, "session", None)
        self._local.session = joined = resolved(session)
        try:
            yield joined
        finally:
            self._local.session = previous

    def enqueue(
        self,
        new: NewJob,
        *,
        session: Session | scoped_session[Any] | Enlistment | None,
        plan: DedupPlan | None = None,
        strict: Strict | None = None,
    ) -> JobHandle:
        """Record ``new`` (deduplicated by ``plan``) and publish it once it has committed.
        With ``strict``, a job returned under ``new``'s id or key must be the same request
        (:mod:`conveyor.client.idempotency`).

        Inside a ``conveyor.client.submit`` span (a child of the caller's current span), whose
        context the row keeps: the job's trace (:mod:`conveyor.tracing`).
        """
        attributes = {"conveyor.stage": new.stage, "conveyor.job_id": new.id, "conveyor.queue": new.queue}
        with tracing.span("conveyor.submit", attributes=attributes, kind=SpanKind.PRODUCER) as span:
            new.trace_context = tracing.carrier()
            handle = self._enqueue(new, session=session, plan=plan, strict=strict)
            if handle.id != new.id:
                span.set_attribute("conveyor.deduplicated_into", handle.id)
            return handle

    def _enqueue(
        self,
        new: NewJob,
        *,
        session: Session | scoped_session[Any] | Enlistment | None,
        plan: DedupPlan | None,
        strict: Strict | None = None,
    ) -> JobHandle:
        if session is not None and not isinstance(session, Enlistment):
            session = resolved(session)
        connections, recorder, fast = self.connections, self.recorder, self.connections.fast
        settings = connections.settings
        now = 0.0
        if plan is not None:
            cached = None
            if plan.fast_path and not new.follow:
                cached = fast.attempt(lambda r: self.deduper.cached(plan.scope, plan.key, new.stage, r))
            if cached is not None:
                hit, now = cached
                if hit is not None:
                    self.metrics.inc("deduplicated", new.stage)
                    handle = self.handle(hit, deduplicated=True)
                    handle.dedup_at = now
                    return handle
            else:
                try:
                    now = recorder.dedup_clock()
                except (DBAPIError, PoolTimeout) as exc:
                    raise _submit_failed(new.stage, exc) from exc
            new.dedup_key = plan.dedup_id
            if plan.dedup.mode == "debounce":
                new.delay = max(new.delay, float(plan.dedup.window or 0))
        # Redis away: the job is inserted unpublished and the relay publishes it later.
        epoch = connections.broker.submit_epoch() if new.due_now else None
        try:
            if session is not None:
                # The caller's transaction: its framework commits or rolls back, never us.
                # Recorded unpublished: marked published after the commit, by the hook that
                # publishes it or, should that never run, by the relay's next pass.
                conn = use_schema(session.connection(), connections.settings.db_schema)
                job_id, created = recorder.record(conn, new, plan, now, None)
            elif plan is None and (lane := connections.lane) is not None:
                # The common submit is one statement (job row + outbox event): no transaction.
                inserted = recorder.insert_on_lane(lane, new, epoch=epoch)
                if inserted is None:
                    with connections.autocommit() as ac:
                        job_id, created = recorder.record(ac, new, None, now, epoch)
                elif inserted:
                    job_id, created = new.id, True
                else:
                    with connections.engine.connect() as conn:
                        found = self.store.find_existing(conn, new.id, new.idempotency_key)
                    if found is None:  # lost a race with a rollback: as the insert path does
                        raise RuntimeError("job insert conflicted but no existing row was found")
                    job_id, created = found, False
            else:
                with connections.engine.begin() as conn:
                    job_id, created = recorder.record(conn, new, plan, now, epoch)
            if strict is not None and not created:
                if session is not None:
                    strict.check(use_schema(session.connection(), settings.db_schema), new, job_id)
                else:
                    with connections.engine.connect() as conn:
                        strict.check(conn, new, job_id)
        except (DBAPIError, PoolTimeout) as exc:
            if session is not None and not is_connection_loss(exc):
                raise  # the caller's transaction: its own error, for it to handle
            raise _submit_failed(new.stage, exc) from exc

        spec = self.stages.get(new.stage)
        joined = session is not None

        def after_commit() -> None:
            if created and new.status == s.WAITING_DEDUP:
                assert new.follows is not None
                self.settle.resolve(new.follows)  # the holder may have ended already
                return
            publish = new.due_now and epoch is not None
            if created and joined:
                if fast.down:
                    return  # the relay publishes it; the cache and preemption can wait
                # A savepoint the session never saw (raw SQL) may have taken the row away
                # before the commit: only a row that is there is published or cached.
                kept = recorder.mark_committed(new, epoch=epoch if publish else None)
                if not kept:
                    if kept is False:
                        log.warning(
                            "job %s (%s) is not in Conveyor's database after its session's commit: "
                            "not published, and no dedup holder. A savepoint the session did not see "
                            "(raw SQL ROLLBACK TO SAVEPOINT) took it, or the session writes to "
                            "another database than Conveyor's",
                            new.id, new.stage,
                        )  # fmt: skip
                    return
                publish = new.published_epoch is not None  # else the relay published it
            if created and plan is not None and plan.dedup.mode != "debounce":
                # The cache is only a fast path; Postgres stays right without it.
                fast.attempt(
                    lambda r: self.deduper.cache(
                        plan.scope, plan.key, new.id, plan.dedup.mode, plan.expires_ms(now), now, r
                    )
                )
            if created and spec is not None and spec.lease_key and not fast.down:
                # Before the publish: the holder starts yielding while the message travels.
                try:
                    self.stops.preempt_holder(new.id, spec, new.payload)
                except Exception:  # the claim asks again
                    log.warning("submit-time preemption request for %s failed", new.id, exc_info=True)
            if created and publish:
                recorder.publish_new(new, fast=True)

        if session is None:
            after_commit()
        elif isinstance(session, Enlistment):
            session.after_commit(after_commit, new.id)
        else:
            session_hooks.after_commit(session, after_commit, new.id, new.stage)
        following = created and new.status == s.WAITING_DEDUP
        handle = self.handle(
            job_id,
            deduplicated=following or not created,
            task_id=new.origin_task_id if created else None,
        )
        handle.dedup_seq = new.dedup_seq
        handle.dedup_at = now if plan is not None else None
        return handle


def _submit_failed(stage: str, exc: BaseException) -> SubmitFailed:
    return SubmitFailed(
        f"could not record a {stage} job: {describe(exc)}; if the connection died while "
        "committing it may have been recorded: retry with the same idempotency_key"
    )


__all__ = ["Submitter"]
