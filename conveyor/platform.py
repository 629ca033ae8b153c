"""The platform object: one per Celery app. It builds both sides and is their front door.

``Platform`` is the composition root: it wires the caller's side (submitting, handles,
cancellation, the DLQ) and the worker's side (runner, completion, flow, heartbeat, relay)
onto shared lower pieces (connections, store, dedup, broker), then delegates its public
API to them. Nothing in ``conveyor`` imports this module; each piece gets what it needs
through its constructor.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from celery import Celery
from kombu.entity import Queue
from pydantic import BaseModel
from redis import Redis
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, scoped_session

from conveyor import shared
from conveyor.client.dlq import DeadLetterQueue
from conveyor.client.enlist import Enlistment
from conveyor.client.followers import Followers
from conveyor.client.handle import JobHandle
from conveyor.client.recorder import Recorder
from conveyor.client.reschedule import reschedule
from conveyor.client.stops import Stops
from conveyor.client.submit import Submitter
from conveyor.dedup import Dedup, Reuse
from conveyor.delivery.broker import Broker
from conveyor.delivery.connections import Connections
from conveyor.delivery.fastpath import FastPath
from conveyor.metrics import Metrics
from conveyor.retry import RetryPolicy
from conveyor.settings import ConveyorSettings
from conveyor.stage import StageSpec
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob, Row
from conveyor.store.liveness import Deliveries
from conveyor.upkeep.reconciler import Reconciler
from conveyor.upkeep.relay import Relay
from conveyor.worker.admission import Admission
from conveyor.worker.completion import Completion
from conveyor.worker.continuations import Continuations
from conveyor.worker.flow import Burial, Flow
from conveyor.worker.gate import Gate
from conveyor.worker.heartbeat import Heartbeat
from conveyor.worker.leases import Leases
from conveyor.worker.runner import Runner
from conveyor.worker.task import StageTask

if TYPE_CHECKING:
    from conveyor.calendar import Window


class Platform:
    """Binds Conveyor to one Celery app: stages, job store, broker, relay."""

    def __init__(
        self,
        app: Celery,
        settings: ConveyorSettings,
        *,
        queues: Sequence[Queue],
        default_queue: str = "default",
    ) -> None:
        self.app = app
        self.queues = list(queues)
        self.queue_names = {q.name for q in self.queues}
        self.default_queue = default_queue
        self.connections = conns = Connections(app, settings, self.queues)
        self.background: list[Any] = []  # relay threads started in this process
        # The shared lower pieces.
        self.stages = Stages(app, conns, queue_names=self.queue_names, default_queue=default_queue)
        self.store = store = JobStore(
            lease_timeout=settings.lease_timeout,
            max_requeues=settings.max_requeues,
            detect_local_dead_owners=settings.detect_local_dead_owners,
            requeue_backoff=settings.infra_backoff,
            requeue_backoff_cap=settings.infra_backoff_cap,
        )
        self.metrics = metrics = Metrics(settings)
        self.deduper = deduper = Deduplicator(settings, lambda: conns.redis)
        self.followers = followers = Followers(store)
        self.deliveries = Deliveries(
            lambda: conns.redis, key_prefix=settings.key_prefix, alive_ttl=settings.worker_alive_ttl
        )
        self.admission = Admission(
            lambda: conns.redis,
            key_prefix=settings.key_prefix,
            slot_ttl=settings.lease_timeout,
            busy_wait=settings.throttle_wait,
        )
        self.recorder = recorder = Recorder(
            conns, store=store, deduper=deduper, followers=followers, metrics=metrics
        )
        # The worker's side: what follows a job's end, then the lifecycle that runs one.
        self.continuations = continuations = Continuations(
            conns,
            stages=self.stages,
            store=store,
            recorder=recorder,
            deduper=deduper,
            followers=followers,
            metrics=metrics,
        )
        self.flow = flow = Flow(
            conns,
            stages=self.stages,
            store=store,
            recorder=recorder,
            continuations=continuations,
            deduper=deduper,
            followers=followers,
            metrics=metrics,
        )
        store.expired_hook = flow.record_expired
        conns.kwargsrepr_for = self._kwargsrepr_of
        # The caller's side; what it sets off once a job ended is the flow's (``Settles``).
        self.stops = stops = Stops(conns, store=store, settle=flow)
        self.submitter = Submitter(
            conns,
            stages=self.stages,
            store=store,
            recorder=recorder,
            deduper=deduper,
            stops=stops,
            settle=flow,
            metrics=metrics,
        )
        self.leases = leases = Leases(conns, store=store, recorder=recorder, stops=stops)
        self.heartbeat = heartbeat = Heartbeat(
            conns, store=store, leases=leases, stops=stops, admission=self.admission, flow=flow
        )
        self.completion = completion = Completion(
            conns,
            store=store,
            continuations=continuations,
            flow=flow,
            heartbeat=heartbeat,
            metrics=metrics,
            leases=leases,
        )
        self.runner = Runner(
            conns,
            store=store,
            recorder=recorder,
            deduper=deduper,
            stops=stops,
            leases=leases,
            gate=Gate(conns, store=store, recorder=recorder, admission=self.admission, metrics=metrics),
            heartbeat=heartbeat,
            completion=completion,
            flow=flow,
            metrics=metrics,
        )
        app.conveyor = self
        shared.attach(self)

    def relay(self) -> Relay:
        """A new relay with its reconciler (the worker's bootstep starts one; tests tick one)."""
        reconciler = Reconciler(
            self.connections,
            stages=self.stages,
            store=self.store,
            recorder=self.recorder,
            flow=self.flow,
            leases=self.leases,
            followers=self.followers,
            metrics=self.metrics,
        )
        return Relay(
            self.connections,
            store=self.store,
            flow=self.flow,
            reconciler=reconciler,
            deliveries=self.deliveries,
            deduper=self.deduper,
            dlq=self.dlq,
        )

    # -- connections ----------------------------------------------------------------------

    @property
    def settings(self) -> ConveyorSettings:
        """The settings every piece reads (replaced by :meth:`bind`)."""
        return self.connections.settings

    @settings.setter
    def settings(self, value: ConveyorSettings) -> None:
        self.connections.settings = value

    @property
    def engine(self) -> Engine:
        """This process's SQLAlchemy engine (bounded pool)."""
        return self.connections.engine

    @property
    def redis(self) -> Redis:
        """This process's Redis client (for Conveyor's own keys)."""
        return self.connections.redis

    @property
    def fast(self) -> FastPath:
        """Redis on the submit path (short timeouts, a breaker)."""
        return self.connections.fast

    @property
    def broker(self) -> Broker:
        """Publisher and epoch keeper."""
        return self.connections.broker

    def autocommit(self) -> AbstractContextManager[Connection]:
        """A connection for single-statement writes (see :meth:`Connections.autocommit`)."""
        return self.connections.autocommit()

    def bind(self, *, redis_url: str, database_url: str, broker_url: str | None = None) -> None:
        """Point the platform (and the Celery app) at concrete services (``broker_url``:
        RabbitMQ's; None: Redis is the broker)."""
        self.connections.bind(redis_url=redis_url, database_url=database_url, broker_url=broker_url)

    def reset(self) -> None:
        """Forget connections (after fork, or after :meth:`bind`)."""
        self.connections.reset()

    def stop_background(self) -> None:
        """Stop relay threads this process started (tests; the worker stops its own)."""
        for thread in self.background:
            thread.stop()
        self.background.clear()

    # -- declaring stages -----------------------------------------------------------------

    def stage(
        self,
        name: str,
        *,
        payload: type[BaseModel] | None = None,
        queue: str | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        time_limit: float | None = None,
        soft_time_limit: float | None = None,
        priority: int = 0,
        label: Callable[[Any], str] | None = None,
        retry_on_timeout: bool = False,
        dedup: Dedup | None = None,
        lease_key: str | None = None,
        preemptable: bool = False,
        grace: float | None = None,
        concurrency: int | None = None,
        concurrency_key: str | None = None,
        concurrency_limit: Callable[[str], int | None] | None = None,
        blackout: Callable[[Any], Iterable[Window]] | None = None,
        max_deferred: float = 600.0,
        on_dead: Callable[[Any, Any, BaseException], Any] | None = None,
        on_retry: Callable[[Any, Any], None] | None = None,
        on_stalled: Callable[[Any, Any, int], None] | None = None,
        on_expired: Callable[[Any, Any], None] | None = None,
        idempotency: Literal["key", "strict"] = "key",
        idempotency_ignore: Collection[str] = (),
        kwargsrepr: Callable[[Mapping[str, Any]], str] | None = None,
        bind: bool = False,
    ) -> Callable[[Callable[..., Any]], StageTask]:
        """Declare a stage: ``fn(ctx, payload) -> result`` becomes the task ``name``; without
        ``payload``, ``fn`` is an ordinary function (``def add(x, y)``): its parameters
        are the payload's fields, in order, and its job is :func:`conveyor.shared.current_job`.

        Policy lives here: queue, attempts, retry schedule, time limits, priority and a
        label function for humans. Deployment overrides (``CONVEYOR_STAGES``) win.
        ``bind=True``, as Celery's, gives a plain-signature body its task as first argument
        (``self.request``, ``self.retry``). ``idempotency="strict"`` refuses a submit that
        names an existing job but is not the same request (:class:`IdempotencyConflict`);
        ``on_expired(conn, payload)`` runs in the transaction that expires a job;
        ``kwargsrepr(payload)`` is what Flower shows of a job's arguments.

        ``concurrency=N`` caps the jobs running at once across all workers; with
        ``concurrency_key="channel:{channel}"`` the cap holds per key (a key's own limit:
        ``concurrency_limit(key)``, or ``concurrency_keys`` in ``CONVEYOR_STAGES``). A job
        over its key's limit is parked and woken when a slot of that key frees.
        ``blackout(payload) -> windows`` (:class:`conveyor.calendar.Window`): a job due
        inside one is parked until the window ends, uncounted, with a ``job.blackout`` event.
        A body that raises :class:`conveyor.errors.Deferred` is parked that long, uncounted,
        up to ``max_deferred`` seconds in all (then a deferral counts as a transient failure).
        """
        register = self.stages.declare(
            name,
            payload=payload,
            queue=queue,
            max_attempts=max_attempts,
            retry=retry,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            concurrency=concurrency,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            blackout=blackout,
            max_deferred=max_deferred,
            priority=priority,
            label=label,
            retry_on_timeout=retry_on_timeout,
            dedup=dedup,
            lease_key=lease_key,
            preemptable=preemptable,
            grace=grace,
            on_dead=on_dead,
            on_retry=on_retry,
            on_stalled=on_stalled,
            on_expired=on_expired,
            idempotency=idempotency,
            idempotency_ignore=frozenset(idempotency_ignore),
            kwargsrepr=kwargsrepr,
            bind=bind,
        )

        def decorate(fn: Callable[..., Any]) -> StageTask:
            spec = register(fn)
            task = self.app.task(
                name=name,
                base=StageTask,
                spec=spec,
                runner=self.runner,
                submitter=self.submitter,
                completion=self.completion,
                time_limit=spec.time_limit,
                soft_time_limit=spec.soft_time_limit,
                queue=spec.queue,
                shared=False,
            )(fn)
            return task  # type: ignore[no-any-return]

        return decorate

    def _kwargsrepr_of(self, stage: str) -> Callable[[Mapping[str, Any]], str] | None:
        spec = self.stages.get(stage)
        return spec.kwargsrepr if spec is not None else None

    def spec(self, stage: str | StageTask | StageSpec) -> StageSpec:
        """Resolve a stage by name, task or spec."""
        return self.stages.spec(stage)

    # -- the caller's side ------------------------------------------------------------------

    def submit(
        self,
        stage: str | StageTask | StageSpec,
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
        """Record a job and publish it after commit (see :meth:`Submitter.submit`)."""
        return self.submitter.submit(
            stage,
            payload,
            session=session,
            idempotency_key=idempotency_key,
            delay=delay,
            run_at=run_at,
            expires_in=expires_in,
            priority=priority,
            label=label,
            max_attempts=max_attempts,
            dedup=dedup,
            reuse=reuse,
            owner=owner,
            job_id=job_id,
        )

    def submit_many(
        self,
        stage: str | StageTask | StageSpec,
        payloads: Sequence[BaseModel | Mapping[str, Any] | None],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        owner: str | None = None,
        delay: float = 0.0,
        priority: int | None = None,
        max_attempts: int | None = None,
        dedup: Dedup | Literal[False] | None = None,
        reuse: Reuse = "never",
        batch_size: int = 1000,
    ) -> list[JobHandle]:
        """Record many jobs of one stage in batches and publish them; their handles in the
        payloads' order (see :meth:`Submitter.submit_many`)."""
        return self.submitter.submit_many(
            stage,
            payloads,
            idempotency_keys=idempotency_keys,
            owner=owner,
            delay=delay,
            priority=priority,
            max_attempts=max_attempts,
            dedup=dedup,
            reuse=reuse,
            batch_size=batch_size,
        )

    def enlisted(self, session: Session | scoped_session[Any]) -> AbstractContextManager[Session]:
        """Make ``delay()``/``apply_async()``/canvases inside the block join ``session``:
        their jobs commit with the caller's own changes and are published after commit."""
        return self.submitter.enlisted(session)

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job."""
        return self.submitter.handle(job_id)

    def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in (see :meth:`Stops.cancel`)."""
        return self.stops.cancel(job_id, by=by, reason=reason)

    def reschedule(
        self, job_id: str, run_at: dt.datetime, *, session: Session | scoped_session[Any] | None = None
    ) -> bool:
        """Move a job not yet claimed (``queued``, ``retrying``, ``throttled``,
        ``waiting_lease``) to ``run_at`` (aware), in ``session``'s transaction if given;
        False once it runs or has ended (:mod:`conveyor.client.reschedule`)."""
        return reschedule(self.connections, self.store, self.recorder, job_id, run_at, session=session)

    @property
    def dlq(self) -> DeadLetterQueue:
        """The dead-letter queue."""
        return DeadLetterQueue(
            self.connections,
            stages=self.stages,
            store=self.store,
            recorder=self.recorder,
            deduper=self.deduper,
        )

    def publish_new(self, new: NewJob) -> None:
        """Publish a freshly committed job. On failure the relay will publish it."""
        self.recorder.publish_new(new)

    def republish_if_queued(self, job_id: str) -> None:
        """Publish ``job_id`` again (fresh task id) if it is still waiting to be claimed."""
        self.recorder.republish_if_queued(job_id)

    def republish(self, row: Row) -> str | None:
        """Publish a stored job again with its stored options and a fresh task id."""
        return self.recorder.republish(row)

    # -- the worker's side ------------------------------------------------------------------

    @property
    def discarded_stream(self) -> str:
        """The capped Redis stream noting copies of jobs that were not run."""
        return self.runner.discarded_stream

    def finished(self, job_id: str, status: str, *, dedup_key: str | None = None) -> None:
        """After a job's terminal transition committed: wake waiters, settle followers."""
        self.flow.finished(job_id, status, dedup_key=dedup_key)

    def bury(
        self,
        conn: Connection,
        row: Row,
        *,
        error: BaseException,
        message: str,
        attempt: int | None = None,
        tb_text: str | None = None,
        from_status: Sequence[str] = (s.RUNNING,),
    ) -> Burial | None:
        """Dead-letter ``row`` outside its stage body (see :meth:`Flow.bury`)."""
        return self.flow.bury(
            conn, row, error=error, message=message, attempt=attempt, tb_text=tb_text, from_status=from_status
        )

    def after_burial(self, burial: Burial | None) -> None:
        """Carry on a burial's flow once it committed (see :meth:`Flow.after_burial`)."""
        self.flow.after_burial(burial)


__all__ = ["Platform"]
