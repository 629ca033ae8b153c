"""Calling Conveyor from an app that has no stage code: submit by stage name, follow, cancel,
and read the dead-letter queue, with only ``conveyor`` installed.

The client reads what each stage accepts from the stage registry (``conveyor db upgrade``
writes it, every worker refreshes it at start), validates a payload against its JSON
Schema, and records the job exactly as the deployment's own platform does: in the
caller's transaction if given one, published after commit, deduplicated by Postgres.
The worker's validation stays authoritative: a rule the schema cannot say (one field
against another) is checked when the job runs, and a refused payload is dead-lettered
with the reason.

::

    import conveyor

    client = conveyor.connect()                    # CONVEYOR_DATABASE_URL, CONVEYOR_REDIS_URL
                                                   # (in Django: settings.CONVEYOR, DATABASES)
    job = client.submit("conveyor.demo.square", {"n": 7}, idempotency_key="order-42")
    job.wait(timeout=30)
    job.result                                     # {"n": 49}
"""

from __future__ import annotations

import builtins
import copy
import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from celery import Celery
from pydantic import BaseModel
from sqlalchemy.engine import Engine, RowMapping
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, scoped_session

from conveyor import connect
from conveyor.client import registry
from conveyor.client.bulk import DEFAULT_BATCH_SIZE, BulkItem, BulkSubmit, check_keys, indexed_invalid
from conveyor.client.dlq import DeadLetterPage, DeadLetterQueue
from conveyor.client.enlist import Enlistment
from conveyor.client.followers import Followers
from conveyor.client.handle import JobHandle
from conveyor.client.owners import owned_key
from conveyor.client.recorder import Recorder
from conveyor.client.registry import RegisteredStage
from conveyor.client.reschedule import reschedule
from conveyor.client.session_hooks import utc_or_none
from conveyor.client.stops import Stops, report_revoked
from conveyor.client.submit import Submitter
from conveyor.dedup import Dedup, DedupPlan, Reuse
from conveyor.delivery.broker import MASKED
from conveyor.delivery.celeryconfig import celery_config
from conveyor.delivery.connections import Connections
from conveyor.errors import (
    PayloadInvalid,
    RetryNeedsDeployment,
    RetryRefused,
    SubmitFailed,
    UnknownStage,
    describe,
)
from conveyor.metrics import Metrics
from conveyor.settings import ConveyorSettings
from conveyor.stage import checked_size
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob


class _Settles:
    """What a client does once a job it cancelled ended: wake its waiters and report it
    revoked to a Celery caller (its chord counts it). Followers (canvas duplicates) are
    never a client's; the workers' reconciler settles them."""

    def __init__(self, connections: Connections, deduper: Deduplicator) -> None:
        self.connections = connections
        self.deduper = deduper

    def finished(self, job_id: str, status: str, *, dedup_key: str | None = None) -> None:
        self.connections.fast.attempt(
            lambda r: r.publish(self.connections.broker.wake_channel(job_id), status)
        )
        if dedup_key:
            self.connections.fast.attempt(lambda r: self.deduper.release(job_id))
        if status in (s.CANCELLED, s.EXPIRED):
            report_revoked(self.connections, job_id)

    def resolve(self, holder: str) -> int:
        return 0


class DeadLetters:
    """The dead-letter queue from a client: list, show, purge, and retry the entries of
    stages the registry says have no ``on_retry`` hook. A hook is deployment code, so any
    other retry is refused (:class:`conveyor.errors.RetryNeedsDeployment`): it is
    ``conveyor dlq retry``'s, or the deployment platform's ``dlq``."""

    def __init__(self, queue: DeadLetterQueue, engine: Callable[[], Engine]) -> None:
        self._queue = queue
        self._engine = engine

    def list(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        page: int = 1,
        per_page: int = 50,
        include_retried: bool = False,
        since: dt.datetime | None = None,
    ) -> DeadLetterPage:
        """Open entries, newest first, each with its job's label."""
        return self._queue.list(
            stage=stage,
            queue=queue,
            page=page,
            per_page=per_page,
            include_retried=include_retried,
            since=since,
        )

    def scan(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        include_retried: bool = False,
        before: int | None = None,
        limit: int = 50,
    ) -> builtins.list[RowMapping]:
        """Entries newest first with ids below ``before`` (see :meth:`DeadLetterQueue.scan`)."""
        return self._queue.scan(
            stage=stage,
            queue=queue,
            since=since,
            until=until,
            include_retried=include_retried,
            before=before,
            limit=limit,
        )

    def show(self, entry_id: int) -> RowMapping | None:
        """One entry, with its traceback and headers."""
        return self._queue.show(entry_id)

    def _hookless(self) -> DeadLetterQueue:
        """The queue, planning retries from a fresh read of the registry (not the client's
        cache: a stage that just gained a hook must not be retried without it)."""
        snapshot = registry.load(self._engine())
        queue = copy.copy(self._queue)
        queue.registered = lambda name: registry.lookup(snapshot, name)
        return queue

    def retry(self, entry_id: int, *, by: str = "api") -> str | None:
        """Retry one entry (see :meth:`DeadLetterQueue.retry`); returns the job id, or None
        when the entry is not open or its job is not dead. Raises
        :class:`RetryNeedsDeployment` for a stage with a hook: :meth:`request_retry` it."""
        return self._hookless().retry(entry_id, by=by)

    def request_retry(self, entry_id: int, *, by: str = "api") -> bool:
        """Ask a worker to retry the entry with its stage's ``on_retry`` hook (the next
        reconciling pass of a worker's relay does, or records why not in ``retry_refused``).
        False when the entry is not open."""
        return self._queue.request_retry(entry_id, by=by)

    def retry_all(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        by: str = "api",
        refused: builtins.list[RetryRefused] | None = None,
        requested: builtins.list[int] | None = None,
    ) -> builtins.list[str]:
        """Retry every open entry matching the filters; refusals go to ``refused``. With
        ``requested``, an entry whose stage has a hook is asked of a worker instead
        (:meth:`request_retry`) and its id goes there."""
        seen: builtins.list[RetryRefused] = []
        ids = self._hookless().retry_all(
            stage=stage, queue=queue, since=since, until=until, by=by, refused=seen
        )
        for exc in seen:
            entry = exc.entry_id if isinstance(exc, RetryNeedsDeployment) else None
            if requested is not None and entry is not None and self.request_retry(entry, by=by):
                requested.append(entry)
            elif refused is not None:
                refused.append(exc)
        return ids

    def purge(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
    ) -> int:
        """Delete the entries matching the filters (none: all of them); returns how many."""
        return self._queue.purge_matching(stage=stage, queue=queue, since=since, until=until)


class Client:
    """Submits jobs by stage name and follows them; needs no stage code.

    Settings come from the environment (``CONVEYOR_DATABASE_URL``, ``CONVEYOR_REDIS_URL``,
    ...) unless given. Only Postgres (or the deployment's SQLite) is needed to submit:
    with Redis away a job is recorded and the workers' relay publishes it later.
    Thread-safe; make one per process and share it.
    """

    def __init__(
        self,
        settings: ConveyorSettings | None = None,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        broker_url: str | None = None,
        registry_ttl: float = 30.0,
    ) -> None:
        base = settings or ConveyorSettings()
        urls = {"database_url": database_url, "redis_url": redis_url, "broker_url": broker_url}
        self.settings = base.model_copy(update={k: v for k, v in urls.items() if v})
        self.app = Celery("conveyor-client", set_as_current=False)
        self.app.config_from_object(celery_config(self.settings, queues=[]))
        self.connections = conns = Connections(self.app, self.settings, [], direct=True)
        self.store = store = JobStore(
            lease_timeout=self.settings.lease_timeout,
            max_requeues=self.settings.max_requeues,
            detect_local_dead_owners=False,
        )
        self.deduper = deduper = Deduplicator(self.settings, lambda: conns.redis)
        metrics = Metrics(self.settings)
        self._recorder = recorder = Recorder(
            conns, store=store, deduper=deduper, followers=Followers(store), metrics=metrics
        )
        settles = _Settles(conns, deduper)
        self._stops = Stops(conns, store=store, settle=settles)
        stages = Stages(self.app, conns, queue_names=(), default_queue="default")
        self._submitter = Submitter(
            conns,
            stages=stages,
            store=store,
            recorder=recorder,
            deduper=deduper,
            stops=self._stops,
            settle=settles,
            metrics=metrics,
        )
        self.dlq = DeadLetters(
            DeadLetterQueue(conns, stages=stages, store=store, recorder=recorder, deduper=deduper),
            lambda: conns.engine,
        )
        self.registry_ttl = registry_ttl
        self._registry: dict[str, RegisteredStage] = {}
        self._loaded_at = float("-inf")
        conns.kwargsrepr_for = self._kwargsrepr_of
        self._lock = threading.Lock()

    # -- stages ---------------------------------------------------------------------------

    def stages(self, *, refresh: bool = False) -> dict[str, RegisteredStage]:
        """The registered stages by name (cached for ``registry_ttl`` seconds)."""
        with self._lock:
            if refresh or time.monotonic() - self._loaded_at > self.registry_ttl:
                self._registry = registry.load(self.connections.engine)
                self._loaded_at = time.monotonic()
            return dict(self._registry)

    def _kwargsrepr_of(self, stage: str) -> Callable[[Mapping[str, Any]], str] | None:
        """A stage that masks its payload in code this client lacks: its messages say so."""
        with self._lock:
            found = self._registry.get(stage)
        return (lambda payload: MASKED) if found is not None and found.masked_repr else None

    def stage(self, name: str) -> RegisteredStage:
        """One registered stage; an unknown name is looked up again once (a worker of a
        newer deployment may have registered it meanwhile), then refused with close names."""
        try:
            return registry.lookup(self.stages(), name)
        except UnknownStage:
            return registry.lookup(self.stages(refresh=True), name)

    # -- jobs -----------------------------------------------------------------------------

    def submit(
        self,
        stage: str,
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
        dedup: Literal[False] | None = None,
        reuse: Reuse = "never",
        owner: str | None = None,
        job_id: str | None = None,
    ) -> JobHandle:
        """Record a job of stage ``stage`` and publish it after commit (as
        :meth:`conveyor.platform.Platform.submit`, whose options these are).

        Raises :class:`conveyor.errors.UnknownStage` (with close names),
        :class:`conveyor.errors.PayloadInvalid` (naming each bad field),
        :class:`conveyor.errors.SubmitFailed` (the database failed). ``dedup=False``
        turns the stage's declared dedup policy off for this submit. ``owner`` names whose
        job it is (an HTTP token of that owner sees it) and scopes ``idempotency_key`` to
        that owner (:class:`conveyor.errors.OwnerInvalid` for a name that is not plain).
        """
        key = owned_key(owner, idempotency_key)
        spec = self._submittable(stage)
        clean = self._checked(spec, payload)
        new = NewJob.submitted(
            stage=spec.name,
            queue=spec.queue,
            payload=clean,
            max_attempts=max_attempts or spec.max_attempts,
            priority=spec.priority if priority is None else priority,
            label=label or spec.name.rsplit(".", 1)[-1],
            idempotency_key=key,
            owner=owner,
            delay=delay,
            expires_in=expires_in,
            run_at=utc_or_none(run_at),
            job_id=job_id,
        )
        # dedup_policy() refuses a stage whose key only its code computes.
        policy = spec.dedup_policy() if dedup is not False else None
        plan = self._plan(spec, policy, clean, reuse)
        return self._submitter.enqueue(new, session=session, plan=plan, strict=spec.strict_rule())

    def submit_many(
        self,
        stage: str,
        payloads: Sequence[BaseModel | Mapping[str, Any] | None],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        owner: str | None = None,
        delay: float = 0.0,
        priority: int | None = None,
        max_attempts: int | None = None,
        dedup: Literal[False] | None = None,
        reuse: Reuse = "never",
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> builtins.list[JobHandle]:
        """Record many jobs of stage ``stage`` in batches and publish them (as
        :meth:`conveyor.platform.Platform.submit_many`); their handles, in order.

        Every payload is checked first as :meth:`submit` checks it: an invalid one raises
        :class:`conveyor.errors.PayloadInvalid` naming its index and nothing is recorded.
        Jobs commit ``batch_size`` at a time (one transaction and one pipelined publish per
        batch): once this returns they are all in the database. ``idempotency_keys`` (one
        per payload, or None) and the stage's dedup policy answer as they do for
        :meth:`submit`; a stage with a dedup policy records its jobs one by one.
        """
        keys = check_keys(len(payloads), idempotency_keys)
        spec = self._submittable(stage)
        policy = spec.dedup_policy() if dedup is not False else None
        items = []
        for i, (payload, key) in enumerate(zip(payloads, keys, strict=True)):
            try:
                clean = self._checked(spec, payload)
            except PayloadInvalid as exc:
                raise indexed_invalid(i, exc) from exc
            new = NewJob.submitted(
                stage=spec.name,
                queue=spec.queue,
                payload=clean,
                max_attempts=max_attempts or spec.max_attempts,
                priority=spec.priority if priority is None else priority,
                label=spec.name.rsplit(".", 1)[-1],
                idempotency_key=owned_key(owner, key),
                owner=owner,
                delay=delay,
            )
            items.append(BulkItem(new, self._plan(spec, policy, clean, reuse)))
        return BulkSubmit(self._submitter).run(items, batch_size=batch_size)

    def _submittable(self, stage: str) -> RegisteredStage:
        """``stage``'s registry entry; a database failure is :class:`SubmitFailed`."""
        try:
            return self.stage(stage)
        except (DBAPIError, PoolTimeout) as exc:
            raise SubmitFailed(
                f"could not look up stage {stage!r}: {describe(exc)}; nothing was recorded"
            ) from exc

    def _plan(
        self, spec: RegisteredStage, policy: Dedup | None, clean: Mapping[str, Any], reuse: Reuse
    ) -> DedupPlan | None:
        """The dedup plan of one payload under the stage's ``policy`` (None: no dedup)."""
        resolved = spec.resolve_dedup(clean) if policy is not None else None
        if policy is None or resolved is None:
            return None
        scope, key = resolved
        return DedupPlan(policy, scope, key, reuse, self.settings.retention_days * 86400)

    def _checked(
        self, spec: RegisteredStage, payload: BaseModel | Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """``payload`` validated against ``spec``'s schema and size limit, JSON-ready."""
        if isinstance(payload, BaseModel):
            data = payload.model_dump(mode="json")
        elif payload is None or isinstance(payload, Mapping):
            data = dict(payload or {})
        else:
            raise PayloadInvalid(
                f"invalid payload for {spec.name}: payload: expected an object (a mapping of field "
                f"names to values), got {type(payload).__name__}"
            )
        return checked_size(spec.name, spec.validate(data), self.settings.max_payload_bytes)

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (``wait``, ``result``, ``cancel``, ``events``)."""
        return self._submitter.handle(job_id)

    def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in (idempotent)."""
        return self._stops.cancel(job_id, by=by, reason=reason)

    def reschedule(
        self, job_id: str, run_at: dt.datetime, *, session: Session | scoped_session[Any] | None = None
    ) -> bool:
        """Move a job not yet claimed to ``run_at`` (aware); False once it runs or has ended
        (:mod:`conveyor.client.reschedule`)."""
        return reschedule(self.connections, self.store, self._recorder, job_id, run_at, session=session)

    def close(self) -> None:
        """Close this client's connections (it reconnects if used again)."""
        self.connections.reset()


__all__ = ["Client", "DeadLetters", "connect"]
