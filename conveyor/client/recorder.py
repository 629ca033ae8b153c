"""Recording a job and publishing it: the one path every new job takes.

A submit, a ``delay()``, a canvas link, a continuation and an adopted message all end in
:meth:`Recorder.record` (the dedup decision, then the row and its outbox event) inside the
caller's transaction, and in :meth:`Recorder.publish_new` once that committed.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import Connection, select, update

from conveyor.client.followers import Followers
from conveyor.dedup import PLAN_OPTION, Dedup, DedupPlan, Reuse
from conveyor.delivery.amqp import Unroutable
from conveyor.delivery.connections import Connections
from conveyor.delivery.ratelimit import TokenBuckets
from conveyor.metrics import Metrics
from conveyor.stage import StageSpec, checked_payload
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import database_clock, db_now
from conveyor.store.db.lane import Lane
from conveyor.store.db.schema import jobs
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob, Row, new_event

log = logging.getLogger("conveyor.recorder")


class Recorder:
    """Inserts jobs (deduplicated) and publishes them once committed."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        deduper: Deduplicator,
        followers: Followers,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.store = store
        self.deduper = deduper
        self.followers = followers
        self.metrics = metrics
        prefix = connections.settings.key_prefix
        self.buckets = TokenBuckets(lambda: connections.fast.client(), key_prefix=prefix)

    def payload_of(self, spec: StageSpec, model: BaseModel) -> dict[str, Any]:
        """``model`` as stored, within the ``max_payload_bytes`` limit (else PayloadTooLarge)."""
        return checked_payload(spec.name, model, self.connections.settings.max_payload_bytes)

    def dedup_plan(
        self, spec: StageSpec, model: BaseModel, override: Dedup | Literal[False] | None, reuse: Reuse
    ) -> DedupPlan | None:
        """The dedup policy of one submit: the override, else the stage's declaration."""
        policy = spec.dedup if override is None else (override or None)
        if policy is None:
            return None
        scope, key = policy.resolve(spec.name, model)
        return DedupPlan(policy, scope, key, reuse, self.connections.settings.retention_days * 86400)

    def insert_job(self, conn: Connection, new: NewJob, *, epoch: str | None) -> bool:
        """Insert ``new`` (marked as published under ``epoch`` if due now) plus its event."""
        if new.due_now and epoch is not None and new.status == s.QUEUED:
            new.published_epoch = epoch
        created = self.store.insert_submitted(conn, new)
        if created:
            self.metrics.inc("submitted", new.stage)
        return created

    def insert_on_lane(self, lane: Lane, new: NewJob, *, epoch: str | None) -> bool | None:
        """:meth:`insert_job` as one prepared statement in autocommit (:mod:`conveyor.store.db.lane`);
        None when ``new`` needs the full insert in a transaction."""
        if new.due_now and epoch is not None and new.status == s.QUEUED:
            new.published_epoch = epoch
        params = self.store.submit_params(new)
        if params is None:
            new.published_epoch = None
            return None
        created = lane.submit(params)
        if created:
            self.metrics.inc("submitted", new.stage)
        return created

    def record(
        self, conn: Connection, new: NewJob, plan: DedupPlan | None, now: float, epoch: str | None
    ) -> tuple[str, bool]:
        """Record ``new`` in ``conn``'s transaction, deduplicated by ``plan``: returns the
        id the caller gets (``new``'s, or the holder's) and whether ``new`` was stored (as a
        job, or as a follower of the holder)."""
        if plan is not None:
            d = plan.dedup
            new.options = {**new.options, PLAN_OPTION: plan.stored()}
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

    # -- publishing -----------------------------------------------------------------------

    def _held_back(self, new: NewJob) -> bool:
        """A fresh job of a rate-limited queue takes its token now, or reserves its own token
        time and waits for it parked ``throttled`` (the relay publishes it then): delivered
        once, never to be parked by the worker and delivered again. True when held back."""
        rate = self.connections.settings.rate_limits.get(new.queue)
        if rate is None:
            return False
        wait = self.buckets.take(new.queue, rate, new.id, hold=True)
        if wait <= 0:
            return False
        body = {"stage": new.stage, "queue": new.queue, "reason": "rate", "at": "publish"}
        with self.connections.engine.begin() as conn:
            return self.store.throttle(conn, new.id, wait=wait, body=body)

    def publish_new(self, new: NewJob, *, fast: bool = False) -> None:
        """Publish a freshly committed job. On failure the relay will publish it. With
        ``fast`` (a submit), Redis gets one short try (:class:`conveyor.delivery.fastpath.FastPath`)."""
        connections = self.connections
        try:
            if fast and connections.fast.down:
                raise ConnectionError("Redis did not answer a moment ago")
            if self._held_back(new):
                return
            connections.broker.publish(
                stage=new.stage,
                job_id=new.id,
                queue=new.queue,
                payload=new.payload,
                options=new.options,
                task_id=new.origin_task_id,
                fast=fast,
                trace_context=new.trace_context,
            )
        except Exception as exc:
            if fast and not isinstance(exc, Unroutable):  # a missing queue is no Redis trouble
                service = "RabbitMQ" if connections.settings.broker_is_amqp() else "Redis"
                connections.fast.trip(type(exc).__name__, service=service)
                log.info("publish of job %s deferred to the relay: %s", new.id, exc)
            else:
                log.warning("publish of job %s failed; the relay will publish it", new.id, exc_info=True)
            try:
                with connections.engine.begin() as conn:
                    conn.execute(
                        update(jobs)
                        .where(jobs.c.id == new.id, jobs.c.status == s.QUEUED)
                        .values(published_at=None)
                    )
            except Exception:
                log.warning("could not mark job %s unpublished; republish_after covers it", new.id)

    def mark_committed(self, new: NewJob, *, epoch: str | None) -> bool | None:
        """After the caller's commit: whether ``new``'s row is in Conveyor's database (None:
        the database did not answer). With ``epoch``, a row nobody published yet (the
        relay may have, at its pass) is also marked published under it, in the same
        statement, and ``new.published_epoch`` set: the caller then publishes it."""
        try:
            with self.connections.autocommit() as conn:
                if epoch is not None:
                    res = conn.execute(
                        update(jobs)
                        .where(
                            jobs.c.id == new.id,
                            jobs.c.status == s.QUEUED,
                            jobs.c.attempts == 0,
                            jobs.c.published_at.is_(None),
                        )
                        .values(celery_task_id=new.origin_task_id, broker_epoch=epoch, published_at=db_now())
                    )
                    if res.rowcount == 1:
                        new.published_epoch = epoch
                        return True
                return conn.execute(select(jobs.c.id).where(jobs.c.id == new.id)).first() is not None
        except Exception as exc:  # the relay publishes it once the database answers
            log.warning("could not mark job %s published after its commit (%s)", new.id, type(exc).__name__)
            return None

    def dedup_clock(self) -> float:
        """The dedup clock: Redis ``TIME`` (asked briefly), else the database's."""
        deduper, fast = self.deduper, self.connections.fast
        if deduper.clock != deduper.redis_time:
            return deduper.clock()  # a virtual clock (tests)
        now = fast.attempt(deduper.redis_time)
        return now if now is not None else database_clock(self.connections.engine)

    def republish_if_queued(self, job_id: str) -> None:
        """Publish ``job_id`` again (fresh task id) if it is still waiting to be claimed."""
        with self.connections.engine.begin() as conn:
            row = self.store.get(conn, job_id)
        if row is None or row["status"] not in s.CLAIMABLE:
            return
        self.republish(row)

    def republish(self, row: Row) -> str | None:
        """Publish a stored job again with its stored options and a fresh task id."""
        broker = self.connections.broker
        epoch = broker.epoch()
        with self.connections.engine.begin() as conn:
            task_id = self.store.mark_for_publish(conn, row, epoch=epoch)
        if task_id is None:
            return None
        broker.publish(
            stage=row["stage"],
            job_id=row["id"],
            queue=row["queue"],
            payload=row["payload"],
            options=row["options"] or {},
            task_id=task_id,
            trace_context=row.get("trace_context"),
        )
        return task_id


__all__ = ["Recorder"]
