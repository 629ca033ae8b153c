"""The platform object: one per Celery app. Declares stages, submits jobs, owns connections."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from celery import Celery, Signature, signature
from celery.app.task import Context
from kombu.entity import Queue
from pydantic import BaseModel
from redis import Redis
from sqlalchemy import Connection, Engine, select, update
from sqlalchemy import event as sa_event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from conveyor import shared
from conveyor.admission import Admission
from conveyor.broker import Broker
from conveyor.celeryconfig import PLACEHOLDER_BROKER
from conveyor.db import schema as s
from conveyor.db.dialect import database_clock, db_now, is_sqlite
from conveyor.db.engine import make_engine
from conveyor.db.schema import jobs, leases
from conveyor.dedup import Dedup, Deduplicator, DedupPlan, Reuse
from conveyor.dlq import DeadLetterQueue
from conveyor.errors import (
    ConfigurationError,
    NotRunning,
    PayloadInvalid,
    PayloadTooLarge,
    SubmitFailed,
    WorkerLost,
    describe,
    is_connection_loss,
)
from conveyor.fastpath import FastPath
from conveyor.followers import Followers, has_flow
from conveyor.handle import JobHandle
from conveyor.leases import CANCEL, PREEMPT, Leases, format_key
from conveyor.liveness import Deliveries
from conveyor.metrics import Metrics
from conveyor.retry import Backoff, RetryPolicy
from conveyor.runner import Runner
from conveyor.settings import ConveyorSettings
from conveyor.stage import (
    StageSpec,
    StageTask,
    checked_payload,
    kept_if_small,
    payload_from_call,
    to_jsonable,
)
from conveyor.store import JobStore, NewJob, Row, new_event

log = logging.getLogger("conveyor")

STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*){2,}$")
PENDING_KEY = "conveyor_pending_publish"


@dataclass
class Burial:
    """A job dead-lettered outside its body, and what must follow once that commits."""

    row: Row
    state: str
    result: Any
    continuation: list[NewJob] = field(default_factory=list)
    chord_member: bool = False


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
        self.settings = settings
        self.queues = list(queues)
        self.queue_names = {q.name for q in self.queues}
        self.default_queue = default_queue
        self.stages: dict[str, StageSpec] = {}
        self.store = JobStore(
            lease_timeout=settings.lease_timeout,
            max_requeues=settings.max_requeues,
            detect_local_dead_owners=settings.detect_local_dead_owners,
        )
        self.runner = Runner(self)
        self.metrics = Metrics(settings)
        self.deduper = Deduplicator(settings, lambda: self.redis)
        self.leases = Leases(self)
        self.followers = Followers(self)
        # Copies of jobs that were not run (duplicates, ended, not due): job, reason, task id.
        self.discarded_stream = f"{settings.key_prefix}discarded"
        self.deliveries = Deliveries(
            lambda: self.redis, key_prefix=settings.key_prefix, alive_ttl=settings.worker_alive_ttl
        )
        self.admission = Admission(
            lambda: self.redis,
            key_prefix=settings.key_prefix,
            slot_ttl=settings.lease_timeout,
            busy_wait=settings.throttle_wait,
        )
        self.fast = FastPath(
            lambda: self.settings.redis_url,
            timeout=settings.submit_redis_timeout,
            cooldown=settings.submit_redis_cooldown,
        )
        self._local = threading.local()
        self.background: list[Any] = []  # relay threads started in this process
        self._engine: Engine | None = None
        self._redis: Redis | None = None
        self._broker: Broker | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        app.conveyor = self
        shared.attach(self)

    # -- wiring -------------------------------------------------------------------------

    def bind(self, *, redis_url: str, database_url: str) -> None:
        """Point the platform (and the Celery app) at concrete services."""
        self.settings = self.settings.with_urls(redis_url, database_url)
        self.app.conf.update(broker_url=redis_url, result_backend=redis_url)
        self.reset()

    def stop_background(self) -> None:
        """Stop relay threads this process started (tests; the worker stops its own)."""
        for thread in self.background:
            thread.stop()
        self.background.clear()

    def reset(self) -> None:
        """Forget connections (after fork, or after :meth:`bind`)."""
        if self._engine is not None:
            self._engine.dispose(close=os.getpid() == self._pid)
        self._engine = None
        self._redis = None
        self._broker = None
        self.fast.reset()
        self._pid = os.getpid()

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            self.reset()

    @property
    def engine(self) -> Engine:
        """This process's SQLAlchemy engine (bounded pool)."""
        self._check_pid()
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    url = self.settings.database_url
                    if not url:
                        raise NotRunning(
                            "no database configured: run `conveyor up` or set CONVEYOR_DATABASE_URL"
                        )
                    self._engine = make_engine(url, pool_size=self.settings.db_pool_size)
        return self._engine

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A connection for single-statement writes: autocommit on Postgres (one round
        trip); on SQLite an ordinary transaction (its writers must BEGIN IMMEDIATE)."""
        if is_sqlite(self.engine):
            with self.engine.begin() as conn:
                yield conn
            return
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    @property
    def redis(self) -> Redis:
        """This process's Redis client (for Conveyor's own keys)."""
        self._check_pid()
        if self._redis is None:
            url = self.settings.redis_url
            if not url or url == PLACEHOLDER_BROKER:
                raise NotRunning("no Redis configured: run `conveyor up` or set CONVEYOR_REDIS_URL")
            self._redis = Redis.from_url(url, health_check_interval=30, socket_timeout=30)
        return self._redis

    @property
    def broker(self) -> Broker:
        """Publisher and epoch keeper."""
        self._check_pid()
        if self._broker is None:
            self._broker = Broker(self.app, self.redis, self.queues, self.settings.key_prefix, fast=self.fast)
        return self._broker

    # -- declaring stages ---------------------------------------------------------------

    def stage(
        self,
        name: str,
        *,
        payload: type[BaseModel],
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
        on_dead: Callable[[Any, Any, BaseException], Any] | None = None,
        on_retry: Callable[[Any, Any], None] | None = None,
        on_stalled: Callable[[Any, Any, int], None] | None = None,
    ) -> Callable[[Callable[..., Any]], StageTask]:
        """Declare a stage: ``fn(ctx, payload) -> result`` becomes the task ``name``.

        Policy lives here: queue, attempts, retry schedule, time limits, priority and a
        label function for humans. Deployment overrides (``CONVEYOR_STAGES``) win.
        """
        if not STAGE_NAME.match(name):
            raise ConfigurationError(f"stage name {name!r} must look like 'conveyor.<family>.<verb>'")
        queue = queue or self.default_queue
        if queue not in self.queue_names:
            raise ConfigurationError(f"stage {name}: queue {queue!r} is not declared in config")
        override = self.settings.stage_override(name)
        hard = override.time_limit or time_limit or self.settings.default_time_limit
        # The soft limit must fire before the hard one, whatever was declared.
        soft = min(
            override.soft_time_limit or soft_time_limit or self.settings.default_soft_time_limit, hard * 0.9
        )
        if hard >= self.settings.visibility_timeout:
            raise ConfigurationError(
                f"stage {name}: hard time limit {hard}s must be below the visibility timeout "
                f"{self.settings.visibility_timeout}s"
            )
        attempts = override.max_attempts or max_attempts or self.settings.default_max_attempts

        def decorate(fn: Callable[..., Any]) -> StageTask:
            spec = StageSpec(
                name=name,
                fn=fn,
                payload=payload,
                queue=queue,
                max_attempts=attempts,
                retry=retry or Backoff(),
                time_limit=hard,
                soft_time_limit=soft,
                priority=priority,
                label=label,
                retry_on_timeout=retry_on_timeout,
                dedup=dedup,
                lease_key=lease_key,
                preemptable=preemptable,
                grace=grace,
                concurrency=override.concurrency or concurrency,
                on_dead=on_dead,
                on_retry=on_retry,
                on_stalled=on_stalled,
            )
            self.stages[name] = spec
            task = self.app.task(
                name=name,
                base=StageTask,
                spec=spec,
                platform=self,
                time_limit=hard,
                soft_time_limit=soft,
                queue=queue,
                shared=False,
            )(fn)
            return task  # type: ignore[no-any-return]

        return decorate

    def spec(self, stage: str | StageTask | StageSpec) -> StageSpec:
        """Resolve a stage by name, task or spec."""
        if isinstance(stage, StageSpec):
            return stage
        name = stage if isinstance(stage, str) else stage.name
        if name not in self.stages:
            # Callers (web apps, the CLI) may not have imported the stage modules yet.
            self.app.loader.import_default_modules()
        try:
            return self.stages[name]
        except KeyError:
            raise ConfigurationError(f"unknown stage {name!r}") from None

    # -- submitting ---------------------------------------------------------------------

    def submit(
        self,
        stage: str | StageTask | StageSpec,
        payload: BaseModel | Mapping[str, Any] | None = None,
        *,
        session: Session | None = None,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        run_at: dt.datetime | None = None,
        expires_in: float | None = None,
        priority: int | None = None,
        label: str | None = None,
        max_attempts: int | None = None,
        dedup: Dedup | Literal[False] | None = None,
        reuse: Reuse = "never",
    ) -> JobHandle:
        """Record a job and publish it after commit. Returns a :class:`JobHandle`.

        With ``session`` the job joins the caller's transaction: it is published only
        if and when that transaction commits. An ``idempotency_key`` seen before returns
        the existing job (any state) with ``deduplicated=True``. ``dedup`` overrides the
        stage's declared policy (``False`` turns it off); ``reuse`` applies to
        deterministic ids. A duplicate never raises: it returns the holder's handle.
        """
        spec = self.spec(stage)
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload or {})
        model = spec.validate(data)
        new = NewJob(
            stage=spec.name,
            queue=spec.queue,
            payload=self.payload_of(spec, model),
            max_attempts=max_attempts or spec.max_attempts,
            priority=spec.priority if priority is None else priority,
            label=label or spec.label_for(model),
            idempotency_key=idempotency_key,
            delay=max(0.0, delay),
            expires_in=expires_in,
            run_at=_utc(run_at),
        )
        new.origin_task_id = new.id
        return self._enqueue(new, session=session, plan=self.dedup_plan(spec, model, dedup, reuse))

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
        model = spec.validate(payload_from_call(args, kwargs))
        # Relative times count on the database's clock; absolute ones are stored as given.
        delay = float(options.get("countdown") or 0.0)
        eta = options.get("eta")
        expires = options.get("expires")
        expires_in = float(expires) if isinstance(expires, (int, float)) else None
        stored = _signature_options(options, link=link, link_error=link_error)
        job_id = task_id or str(uuid.uuid4())
        new = NewJob(
            id=job_id,
            stage=spec.name,
            queue=options.get("queue") or spec.queue,
            payload=self.payload_of(spec, model),
            max_attempts=spec.max_attempts,
            priority=spec.priority,
            label=spec.label_for(model),
            delay=max(0.0, delay),
            expires_in=expires_in,
            run_at=_utc(eta),
            expires_at=_utc(expires) if not isinstance(expires, (int, float)) else None,
            options=stored,
            origin_task_id=job_id,
            parent_id=options.get("parent_id") or None,
        )
        if isinstance(new.queue, Queue):
            new.queue = new.queue.name
        new.follow = has_flow(stored) or task_id is not None
        session = getattr(self._local, "session", None)
        return self._enqueue(new, session=session, plan=self.dedup_plan(spec, model, None, "never"))

    @contextmanager
    def enlisted(self, session: Session) -> Iterator[Session]:
        """Make ``delay()``/``apply_async()``/canvases inside the block join ``session``:
        their jobs commit with the caller's own changes and are published after commit."""
        previous = getattr(self._local, "session", None)
        self._local.session = session
        try:
            yield session
        finally:
            self._local.session = previous

    def payload_of(self, spec: StageSpec, model: BaseModel) -> dict[str, Any]:
        """``model`` as stored, within the ``max_payload_bytes`` limit (else PayloadTooLarge)."""
        return checked_payload(spec.name, model, self.settings.max_payload_bytes)

    def dedup_plan(
        self, spec: StageSpec, model: BaseModel, override: Dedup | Literal[False] | None, reuse: Reuse
    ) -> DedupPlan | None:
        """The dedup policy of one submit: the override, else the stage's declaration."""
        policy = spec.dedup if override is None else (override or None)
        if policy is None:
            return None
        scope, key = policy.resolve(spec.name, model)
        return DedupPlan(policy, scope, key, reuse, self.settings.retention_days * 86400)

    def finished(self, job_id: str, status: str, *, dedup_key: str | None = None) -> None:
        """After a job's terminal transition committed: wake waiters, free its cached dedup key."""
        try:
            self.broker.notify(job_id, status)
            if dedup_key:
                self.deduper.release(job_id)
        except Exception:  # both are fast paths; Postgres already has the truth
            log.warning("post-terminal notification for %s failed", job_id, exc_info=True)
        if dedup_key:
            try:
                self.followers.resolve(job_id)
            except Exception:  # the reconciler settles them
                log.warning("could not settle followers of %s", job_id, exc_info=True)

    def continuation(self, sig: Signature, result: Any, parent: Row, extra: Mapping[str, Any]) -> NewJob:
        """The job a chain link or link callback becomes; its id is fixed by the canvas."""
        spec = self.spec(sig.task)
        args = tuple(sig.args or ())
        if not sig.immutable:
            args = (result, *args)
        invalid: tuple[str, str] | None = None
        raw: Any = {}
        try:
            raw = payload_from_call(args, dict(sig.kwargs or {}))
            model = spec.validate(raw)
            payload = self.payload_of(spec, model)
        except PayloadInvalid as exc:
            # The parent's success stands; this link is dead-lettered with the reason.
            invalid, payload = (type(exc).__name__, str(exc)), kept_if_small(raw, exc)
        opts = dict(sig.options or {})
        task_id = opts.pop("task_id", None)
        job_id = task_id or str(uuid.uuid5(uuid.NAMESPACE_URL, f"conveyor:next:{parent['id']}:{sig.task}"))
        stored = _signature_options(
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
            invalid=invalid,
        )
        if invalid is None:
            # The same dedup decision as submit(); a canvas waits on this id, so a duplicate
            # becomes a follower of the holder rather than vanishing into it.
            new.plan = self.dedup_plan(spec, model, None, "never")
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
        created: list[NewJob] = []
        took_chain = took_callbacks = False
        if chain:
            nxt = signature(chain[-1], app=self.app)
            if nxt.task in self.stages:
                created.append(
                    self.continuation(nxt, result, parent, {**extra, "chain": list(chain[:-1]) or None})
                )
                took_chain = True
        sigs = [signature(c, app=self.app) for c in callbacks]
        if sigs and all(cb.task in self.stages for cb in sigs):
            created += [self.continuation(cb, result, parent, extra) for cb in sigs]
            took_callbacks = True
        return created, took_chain, took_callbacks

    def insert_continuations(
        self, conn: Connection, created: Sequence[NewJob], *, upstream: str
    ) -> list[NewJob]:
        """Insert a completion's continuation jobs in its transaction.

        A continuation that exists already belongs to an upstream job completing again
        after a DLQ retry: it runs again with the new input (``rerun``), so a flow resumes
        from the failed stage. Returns the jobs to publish after commit.
        """
        out: list[NewJob] = []
        if not created:
            return out
        epoch = self.broker.epoch()
        for new in created:
            plan: DedupPlan | None = new.plan
            if new.invalid is not None:
                if self._insert_dead(conn, new):
                    out.append(new)
                continue
            if plan is None:
                inserted = self.insert_job(conn, new, epoch=epoch)
            else:
                now = self.deduper.clock()
                new.dedup_key = plan.dedup_id
                if plan.dedup.mode == "debounce":
                    new.delay = max(new.delay, float(plan.dedup.window or 0))
                job_id, inserted = self._record(conn, new, plan, now, epoch)
                inserted = inserted and job_id == new.id
            if inserted:
                out.append(new)
                continue
            spec = self.stages.get(new.stage)
            budget = spec.max_attempts if spec else self.settings.default_max_attempts
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
        return out

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

    def publish_continuations(self, created: Sequence[NewJob]) -> None:
        """After commit: publish new continuation jobs; rerun ones get a fresh task id."""
        for new in created:
            if new.status == s.DEAD:
                assert new.invalid is not None
                kind = PayloadTooLarge if new.invalid[0] == PayloadTooLarge.__name__ else PayloadInvalid
                self.report_failure(new.id, new.options, kind(new.invalid[1]))
                self.finished(new.id, s.DEAD)
            elif new.status == s.WAITING_DEDUP:
                assert new.follows is not None
                self.followers.resolve(new.follows)  # the holder may have ended already
            elif new.rerun:
                try:
                    self.republish_if_queued(new.id)
                except Exception:  # the relay publishes it after republish_after
                    log.warning("republish of rerun job %s failed", new.id, exc_info=True)
            elif new.due_now:
                self.publish_new(new)

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
        """Dead-letter ``row`` outside its stage body (worker lost, hard time limit).

        A stage with ``on_dead`` carries on as its body would have: the hook's result goes
        down the flow (chain link, callbacks, or its chord's counter), so a flow never
        waits on a job that died with its worker. Without the hook a chord member fails its
        chord, as Celery would. Call :meth:`after_burial` once committed.
        """
        if not self.store.dead_letter(
            conn,
            row,
            error_type=type(error).__name__,
            message=message,
            tb_text=tb_text,
            attempt=attempt,
            from_status=from_status,
        ):
            return None
        if isinstance(error, WorkerLost):
            # The last attempt stalled too: the stage hears of it as of any other stall.
            self.record_stalled(conn, row, int(attempt if attempt is not None else row["attempts"]))
        options = row["options"] or {}
        burial = Burial(row=row, state="FAILURE", result=error)
        burial.chord_member = bool(options.get("chord")) and not options.get("chain")
        carried = self.carry_on(conn, row, error)
        if carried is not None:
            (result,) = carried
            extra = {
                "parent_id": row["celery_task_id"],
                "root_id": options.get("root_id") or row["celery_task_id"],
            }
            created, _, _ = self.next_jobs(
                options.get("chain") or [], options.get("link") or [], row, result, extra
            )
            burial.continuation = self.insert_continuations(conn, created, upstream=str(row["id"]))
            burial.state, burial.result = "SUCCESS", result
        return burial

    def carry_on(self, conn: Connection, row: Row, error: BaseException) -> tuple[Any] | None:
        """In a dead-letter transaction: run the stage's ``on_dead`` hook, if it has one,
        and store its result as the job's. Returns that result as a 1-tuple (it goes down
        the flow instead of the error), or None without a hook."""
        spec = self.stages.get(row["stage"])
        if spec is None or spec.on_dead is None:
            return None
        result = to_jsonable(spec.on_dead(conn, row["payload"], error))
        conn.execute(update(jobs).where(jobs.c.id == row["id"]).values(result=result))
        return (result,)

    def record_stalled(self, conn: Connection, row: Row, attempts: int) -> None:
        """A lost worker's attempt was taken over: let the stage record it (``on_stalled``).

        In a savepoint of the caller's transaction: a failing hook never undoes the
        takeover or the requeue.
        """
        spec = self.stages.get(row["stage"])
        if spec is None or spec.on_stalled is None:
            return
        try:
            with conn.begin_nested():
                spec.on_stalled(conn, row["payload"], attempts)
        except Exception:
            log.warning("on_stalled hook of %s failed for %s", row["stage"], row["id"], exc_info=True)

    def after_burial(self, burial: Burial | None) -> None:
        """Publish a burial's continuation, count it in its chord, wake its waiters."""
        if burial is None:
            return
        row = burial.row
        self.metrics.inc("dead", row["stage"])
        self.publish_continuations(burial.continuation)
        if burial.chord_member:
            self.count_in_chord(row, burial.state, burial.result)
        if burial.state == "FAILURE":
            self.report_failure(row["origin_task_id"] or row["id"], row["options"] or {}, burial.result)
        self.finished(row["id"], s.DEAD, dedup_key=row["dedup_key"])

    def report_failure(self, task_id: str, options: Mapping[str, Any], error: BaseException) -> None:
        """Store a failure no worker reported (a burial, a link that could never run) in
        the result backend, for the task and the rest of its chain, as Celery does for a
        task that raised: ``AsyncResult.get()`` raises instead of waiting forever. Chord
        counting is the caller's (``count_in_chord``)."""
        request = Context(id=task_id, chain=options.get("chain"), root_id=options.get("root_id"))
        try:
            self.app.backend.mark_as_failure(task_id, error, request=request, call_errbacks=False)
        except Exception:
            log.warning("could not store the failure of task %s", task_id, exc_info=True)

    def count_in_chord(self, row: Row, state: str, result: Any) -> None:
        """Count a job that ended outside its own delivery (buried, or settled as a
        follower) in its chord's counter, as Celery counts a member that ran."""
        options = row["options"] or {}
        if not options.get("chord") or options.get("chain"):
            return
        request = Context(
            id=row["celery_task_id"] or row["origin_task_id"],
            group=options.get("group_id"),
            group_index=options.get("group_index"),
            chord=options.get("chord"),
            root_id=options.get("root_id"),
        )
        try:
            self.app.backend.on_chord_part_return(request, state, result)
        except Exception:
            log.warning("could not count job %s in its chord", row["id"], exc_info=True)

    def insert_job(self, conn: Connection, new: NewJob, *, epoch: str | None) -> bool:
        """Insert ``new`` (marked as published under ``epoch`` if due now) plus its event."""
        if new.due_now and epoch is not None and new.status == s.QUEUED:
            new.published_epoch = epoch
        created = self.store.insert_submitted(conn, new)
        if created:
            self.metrics.inc("submitted", new.stage)
        return created

    def _enqueue(self, new: NewJob, *, session: Session | None, plan: DedupPlan | None = None) -> JobHandle:
        """Record ``new`` (deduplicated by ``plan``) and publish it once it has committed."""
        now = 0.0
        if plan is not None:
            cached = None
            if plan.fast_path and not new.follow:
                cached = self.fast.attempt(lambda r: self.deduper.cached(plan.scope, plan.key, new.stage, r))
            if cached is not None:
                hit, now = cached
                if hit is not None:
                    self.metrics.inc("deduplicated", new.stage)
                    handle = JobHandle(self, hit, deduplicated=True)
                    handle.dedup_at = now
                    return handle
            else:
                try:
                    now = self._dedup_clock()
                except (DBAPIError, PoolTimeout) as exc:
                    raise _submit_failed(new.stage, exc) from exc
            new.dedup_key = plan.dedup_id
            if plan.dedup.mode == "debounce":
                new.delay = max(new.delay, float(plan.dedup.window or 0))
        # Redis away: the job is inserted unpublished and the relay publishes it later.
        epoch = self.broker.submit_epoch() if new.due_now else None
        try:
            if session is not None:
                job_id, created = self._record(session.connection(), new, plan, now, epoch)
            elif plan is None and not is_sqlite(self.engine):
                # The common submit is one statement (job row + outbox event): no transaction.
                with self.autocommit() as ac:
                    job_id, created = self._record(ac, new, None, now, epoch)
            else:
                with self.engine.begin() as conn:
                    job_id, created = self._record(conn, new, plan, now, epoch)
        except (DBAPIError, PoolTimeout) as exc:
            if session is not None and not is_connection_loss(exc):
                raise  # the caller's transaction: its own error, for it to handle
            raise _submit_failed(new.stage, exc) from exc

        spec = self.stages.get(new.stage)

        def after_commit() -> None:
            if created and new.status == s.WAITING_DEDUP:
                assert new.follows is not None
                self.followers.resolve(new.follows)  # the holder may have ended already
                return
            if created and plan is not None and plan.dedup.mode != "debounce":
                # The cache is only a fast path; Postgres stays right without it.
                self.fast.attempt(
                    lambda r: self.deduper.cache(
                        plan.scope, plan.key, new.id, plan.dedup.mode, plan.expires_ms(now), now, r
                    )
                )
            if created and spec is not None and spec.lease_key and not self.fast.down:
                # Before the publish: the holder starts yielding while the message travels.
                try:
                    self._request_preemption_for(new.id, spec, new.payload)
                except Exception:  # the claim asks again
                    log.warning("submit-time preemption request for %s failed", new.id, exc_info=True)
            if created and new.due_now and epoch is not None:
                self.publish_new(new, fast=True)

        if session is None:
            after_commit()
        else:
            _after_commit(session, after_commit, new.id)
        following = created and new.status == s.WAITING_DEDUP
        handle = JobHandle(
            self,
            job_id,
            deduplicated=following or not created,
            task_id=new.origin_task_id if created else None,
        )
        handle.dedup_seq = new.dedup_seq
        handle.dedup_at = now if plan is not None else None
        return handle

    def _record(
        self, conn: Connection, new: NewJob, plan: DedupPlan | None, now: float, epoch: str | None
    ) -> tuple[str, bool]:
        if plan is not None:
            d = plan.dedup
            if d.mode == "debounce":
                new.dedup_seq = self.deduper.sequence(conn)
            acq = self.deduper.acquire(
                conn,
                scope=plan.scope,
                key=plan.key,
                mode=d.mode,
                job_id=new.id,
                now=now,
                ttl=plan.ttl,
                reuse=plan.reuse,
            )
            if not acq.won and acq.holder != new.id:  # holding it already: a redelivery
                stolen = False
                if d.mode == "debounce":
                    assert d.window is not None and new.dedup_seq is not None
                    if not self.deduper.debounce(
                        conn,
                        scope=plan.scope,
                        key=plan.key,
                        holder=acq.holder,
                        payload=new.payload,
                        seq=new.dedup_seq,
                        now=now,
                        window=d.window,
                        max_wait=d.max_wait,
                    ):
                        stolen = self.deduper.steal(
                            conn,
                            scope=plan.scope,
                            key=plan.key,
                            old=acq.holder,
                            new=new.id,
                            mode=d.mode,
                            now=now,
                            ttl=plan.ttl,
                        )
                if not stolen:
                    body = {
                        "stage": new.stage,
                        "dedup_id": plan.dedup_id,
                        "existing_job": acq.holder,
                        "mode": d.mode,
                    }
                    if new.follow:
                        body["follower"] = new.id
                    self.store.emit(conn, [new_event(acq.holder, "job.deduplicated", body)])
                    self.metrics.inc("deduplicated", new.stage)
                    if new.follow:
                        return new.id, self.followers.follow(conn, new, acq.holder)
                    return acq.holder, False
        created = self.insert_job(conn, new, epoch=epoch)
        if created:
            return new.id, True
        found = self.store.find_existing(conn, new.id, new.idempotency_key)
        assert found is not None
        return found, False

    def publish_new(self, new: NewJob, *, fast: bool = False) -> None:
        """Publish a freshly committed job. On failure the relay will publish it. With
        ``fast`` (a submit), Redis gets one short try (:class:`FastPath`)."""
        try:
            if fast and self.fast.down:
                raise ConnectionError("Redis did not answer a moment ago")
            self.broker.publish(
                stage=new.stage,
                job_id=new.id,
                queue=new.queue,
                payload=new.payload,
                options=new.options,
                task_id=new.origin_task_id,
                fast=fast,
            )
        except Exception as exc:
            if fast:
                self.fast.trip(type(exc).__name__)
                log.info("publish of job %s deferred to the relay: %s", new.id, exc)
            else:
                log.warning("publish of job %s failed; the relay will publish it", new.id, exc_info=True)
            try:
                with self.engine.begin() as conn:
                    conn.execute(
                        update(jobs)
                        .where(jobs.c.id == new.id, jobs.c.status == s.QUEUED)
                        .values(published_at=None)
                    )
            except Exception:
                log.warning("could not mark job %s unpublished; republish_after covers it", new.id)

    def _dedup_clock(self) -> float:
        """The dedup clock: Redis ``TIME`` (asked briefly), else the database's."""
        if self.deduper.clock != self.deduper.redis_time:
            return self.deduper.clock()  # a virtual clock (tests)
        now = self.fast.attempt(self.deduper.redis_time)
        return now if now is not None else database_clock(self.engine)

    def republish_if_queued(self, job_id: str) -> None:
        """Publish ``job_id`` again (fresh task id) if it is still waiting to be claimed."""
        with self.engine.begin() as conn:
            row = self.store.get(conn, job_id)
        if row is None or row["status"] not in s.CLAIMABLE:
            return
        self.republish(row)

    def republish(self, row: Row) -> str | None:
        """Publish a stored job again with its stored options and a fresh task id."""
        epoch = self.broker.epoch()
        with self.engine.begin() as conn:
            task_id = self.store.mark_for_publish(conn, row, epoch=epoch)
        if task_id is None:
            return None
        self.broker.publish(
            stage=row["stage"],
            job_id=row["id"],
            queue=row["queue"],
            payload=row["payload"],
            options=row["options"] or {},
            task_id=task_id,
        )
        return task_id

    # -- cancellation & preemption ------------------------------------------------------

    def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in (idempotent).

        A queued, delayed or parked job ends ``cancelled`` at once (a message already on
        the broker finds it cancelled at claim, even if every worker was offline when
        this ran). A running job is asked to stop: it raises ``Cancelled`` at its next
        checkpoint, or is interrupted after its grace period. A job that already finished
        keeps its final state, which is returned.
        """
        stop: tuple[int, str | None] | None = None
        with self.engine.begin() as conn:
            # Locked: a claim or requeue committing between our read and write would make the
            # compare-and-set miss and the cancel vanish.
            row = (
                conn.execute(select(jobs).where(jobs.c.id == job_id).with_for_update())
                .mappings()
                .one_or_none()
            )
            if row is None:
                raise LookupError(f"job {job_id} not found")
            status = str(row["status"])
            who = {"cancelled_by": by[:200], "cancel_reason": reason}
            if status in (*s.CLAIMABLE, s.WAITING_LEASE, s.WAITING_DEDUP):
                ok = self.store.finish(
                    conn,
                    row,
                    s.CANCELLED,
                    from_status=(status,),
                    topic="job.cancelled",
                    body={"by": by, "reason": reason, "while": status},
                )
                if ok:
                    conn.execute(
                        update(jobs).where(jobs.c.id == job_id).values(cancel_requested_at=db_now(), **who)
                    )
                    status = s.CANCELLED
                else:
                    status = str(self.store.get(conn, job_id)["status"])  # type: ignore[index]
            elif status == s.RUNNING:
                res = conn.execute(
                    update(jobs)
                    .where(
                        jobs.c.id == job_id, jobs.c.status == s.RUNNING, jobs.c.cancel_requested_at.is_(None)
                    )
                    .values(cancel_requested_at=db_now(), **who)
                )
                if res.rowcount == 1:
                    self.store.emit(
                        conn, [new_event(job_id, "job.cancel_requested", {"by": by, "reason": reason})]
                    )
                stop = (int(row["attempts"]), row["celery_task_id"])
        if stop is not None:
            self.leases.flag(job_id, stop[0], CANCEL, stop[1])
        elif status == s.CANCELLED:
            self.finished(job_id, status, dedup_key=row["dedup_key"])
        return status

    def _request_preemption_for(self, job_id: str, spec: StageSpec, payload: Mapping[str, Any]) -> None:
        """Submit-time preemption: ask a lower-priority preemptable holder of the lease to
        yield now, so it stops even if no pool slot is free for the new job."""
        assert spec.lease_key is not None
        key = format_key(spec.lease_key, payload)
        flag: tuple[str, int, str | None] | None = None
        with self.engine.begin() as conn:
            lease = conn.execute(select(leases).where(leases.c.key == key)).mappings().one_or_none()
            if lease is None or lease["holder_job"] in (None, job_id):
                return
            if self.leases.request_preemption(conn, lease, by_job=job_id, priority=spec.priority):
                holder = self.store.get(conn, lease["holder_job"])
                if holder is not None and holder["status"] == s.RUNNING:
                    flag = (str(holder["id"]), int(holder["attempts"]), holder["celery_task_id"])
        if flag is not None:
            self.leases.flag(flag[0], flag[1], PREEMPT, flag[2])

    # -- handles ------------------------------------------------------------------------

    @property
    def dlq(self) -> DeadLetterQueue:
        """The dead-letter queue."""
        return DeadLetterQueue(self)

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job."""
        return JobHandle(self, job_id)


def _submit_failed(stage: str, exc: BaseException) -> SubmitFailed:
    return SubmitFailed(
        f"could not record a {stage} job: {describe(exc)}; if the connection died while "
        "committing it may have been recorded: retry with the same idempotency_key"
    )


def _signature_options(options: Mapping[str, Any], *, link: Any, link_error: Any) -> dict[str, Any]:
    """The subset of apply_async options needed to publish the same message again."""
    keep = ("chain", "chord", "group_id", "group_index", "parent_id", "root_id")
    out = {k: _plain(options[k]) for k in keep if options.get(k) is not None}
    if link:
        out["link"] = _plain(link if isinstance(link, list) else [link])
    if link_error:
        out["link_error"] = _plain(link_error if isinstance(link_error, list) else [link_error])
    return out


def _utc(value: Any) -> dt.datetime | None:
    """An absolute time as an aware UTC datetime (naive ones are taken as UTC)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if not isinstance(value, dt.datetime):
        raise TypeError(f"expected a datetime, got {type(value).__name__}")
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)


def _plain(value: Any) -> Any:
    """Signatures are dicts; make nested ones plain JSON-able structures."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _after_commit(session: Session, fn: Callable[[], None], job_id: str) -> None:
    """Run ``fn`` once ``session``'s outermost transaction commits.

    Dropped if the transaction it was registered in rolls back, or any savepoint around
    it does; a savepoint rolled back *beside* it (before or after) leaves it alone.
    """
    pending: list[tuple[Any, Callable[[], None], str]] = session.info.setdefault(PENDING_KEY, [])
    if not session.info.get(PENDING_KEY + "_hooked"):
        session.info[PENDING_KEY + "_hooked"] = True

        def on_commit(sess: Session) -> None:
            if sess.get_nested_transaction() is not None:
                return  # a savepoint was released: its work commits (or not) with the outer one
            todo = sess.info.get(PENDING_KEY) or []
            sess.info[PENDING_KEY] = []
            bind = sess.bind
            if isinstance(bind, Connection) and bind.in_transaction():
                # The session joined a transaction it does not own (a test fixture's, a
                # framework's): its commit only released a savepoint, and Core has no
                # after-commit hook. Leave the jobs to the relay, inside that transaction:
                # published within a relay interval if it commits, never if it rolls back.
                ids = [job_id for _, _, job_id in todo]
                bind.execute(
                    update(jobs)
                    .where(jobs.c.id.in_(ids), jobs.c.status == s.QUEUED)
                    .values(published_at=None, broker_epoch=None)
                )
                return
            for _, f, _ in todo:
                f()

        def on_rollback(sess: Session, ended: Any) -> None:
            sess.info[PENDING_KEY] = [
                entry for entry in sess.info.get(PENDING_KEY) or [] if not _within(entry[0], ended)
            ]

        sa_event.listen(session, "after_commit", on_commit)
        sa_event.listen(session, "after_soft_rollback", on_rollback)
    current = session.get_nested_transaction() or session.get_transaction()
    pending.append((current, fn, job_id))


def _within(tx: Any, ancestor: Any) -> bool:
    """Whether session transaction ``tx`` is ``ancestor`` or nested inside it."""
    while tx is not None:
        if tx is ancestor:
            return True
        tx = tx.parent
    return False
