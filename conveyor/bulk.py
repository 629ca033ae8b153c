"""Bulk submit: ``submit_many()`` records many jobs in a few transactions and publishes
them through one pipelined Redis call per batch.

The caller's side (the platform's :class:`conveyor.submit.Submitter` and the web app's
:class:`conveyor.client.Client`) validates every payload and builds each job exactly as
``submit()`` does; :class:`BulkSubmit` then records them:

* Jobs whose stage has a dedup policy (or that the call gives one) go through
  ``submit()``'s own path, one by one (:meth:`Submitter.enqueue`): the dedup decision
  (cache, ``dedup_keys`` row, followers, debounce) is per job and cannot be made for a
  whole batch at once without changing what it answers.
* Every other job is inserted ``batch_size`` at a time: on Postgres one
  ``INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING`` that writes each row and
  its ``job.submitted`` event, one synchronous transaction per batch; on SQLite a loop of
  the ordinary inserts in one transaction per batch. The rows of jobs due now are
  inserted as already published under the current broker epoch (as ``submit()``'s are);
  once the batch has committed its messages go out through one pipeline
  (:meth:`conveyor.broker.Broker.publish_many`). If Redis is away (no epoch) the rows are
  inserted unpublished; if the publish fails they are marked unpublished: either way the
  relay publishes them (and ``republish_after`` covers a mark that failed too).

Idempotency keys are honoured as ``submit()`` honours them: a key recorded before returns
the existing job's handle with ``deduplicated=True``, and a key given twice in one call
records the first job only, the later ones getting its handle with ``deduplicated=True``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.trace import SpanKind
from sqlalchemy import Connection, Float, Integer, String, bindparam, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from conveyor import tracing
from conveyor.broker import Outgoing
from conveyor.connections import Connections
from conveyor.db import schema as s
from conveyor.db.dialect import is_sqlite
from conveyor.db.namespace import schema_of
from conveyor.db.schema import jobs
from conveyor.dedup import DedupPlan
from conveyor.errors import PayloadInvalid, SubmitFailed, describe
from conveyor.handle import JobHandle
from conveyor.metrics import Metrics
from conveyor.recorder import Recorder
from conveyor.store import JobStore, NewJob

log = logging.getLogger("conveyor.bulk")

DEFAULT_BATCH_SIZE = 1000


@dataclass
class BulkItem:
    """One job of a ``submit_many()`` call, validated and built as ``submit()`` builds it,
    with its dedup plan (None: no dedup policy applies)."""

    new: NewJob
    plan: DedupPlan | None = None


def indexed_invalid(index: int, exc: PayloadInvalid) -> PayloadInvalid:
    """``exc`` (or its subclass) again, its message naming the payload's ``index``."""
    return type(exc)(f"payloads[{index}]: {exc}", problems=exc.problems)


def batches(items: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Enqueuer(Protocol):
    """What :class:`BulkSubmit` uses of a :class:`conveyor.submit.Submitter`."""

    connections: Connections
    recorder: Recorder
    metrics: Metrics

    def handle(self, job_id: str, *, deduplicated: bool = False, task_id: str | None = None) -> JobHandle:
        """A handle on job ``job_id``."""
        ...

    def enqueue(self, new: NewJob, *, session: None, plan: DedupPlan | None = None) -> JobHandle:
        """Record one job as ``submit()`` does and publish it once committed."""
        ...


def check_keys(count: int, keys: Sequence[str | None] | None) -> Sequence[str | None]:
    """One idempotency key (or None) per payload."""
    if keys is None:
        return [None] * count
    if len(keys) != count:
        raise ValueError(f"idempotency_keys has {len(keys)} entries for {count} payloads")
    return keys


class BulkSubmit:
    """Records validated jobs in batches and publishes each batch once it has committed."""

    def __init__(self, submitter: Enqueuer) -> None:
        self.submitter = submitter
        self.connections = submitter.connections

    def run(self, items: Sequence[BulkItem], *, batch_size: int = DEFAULT_BATCH_SIZE) -> list[JobHandle]:
        """Record ``items`` (see the module's docstring); their handles in the same order.

        Raises :class:`conveyor.errors.SubmitFailed` if the database fails: the batches
        committed before it stay recorded, so retry the call with the same idempotency keys.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        handles: list[JobHandle | None] = [None] * len(items)
        first: dict[str, int] = {}  # idempotency key -> the index that records it
        repeats: list[tuple[int, int]] = []
        plain: list[int] = []
        planned: list[int] = []
        for i, item in enumerate(items):
            key = item.new.idempotency_key
            if key is not None:
                if key in first:
                    repeats.append((i, first[key]))
                    continue
                first[key] = i
            (planned if item.plan is not None else plain).append(i)
        attributes = {
            "conveyor.stage_count": len({it.new.stage for it in items}),
            "conveyor.jobs": len(items),
        }
        done = 0
        with tracing.span("conveyor.submit_many", attributes=attributes, kind=SpanKind.PRODUCER):
            carrier = tracing.carrier()
            try:
                for chunk in batches(plain, batch_size):
                    chunk_items = [items[i] for i in chunk]
                    for i, handle in zip(chunk, self._batch(chunk_items, carrier), strict=True):
                        handles[i] = handle
                    done += len(chunk)
            except (DBAPIError, PoolTimeout) as exc:
                raise SubmitFailed(
                    f"could not record a batch of jobs: {describe(exc)}; {done} of {len(items)} were "
                    "recorded before it (the failing batch may have committed if the connection died "
                    "while committing): retry with the same idempotency keys"
                ) from exc
            for i in planned:
                handles[i] = self.submitter.enqueue(items[i].new, session=None, plan=items[i].plan)
        for i, j in repeats:
            held = handles[j]
            assert held is not None
            handles[i] = self.submitter.handle(held.id, deduplicated=True)
        return [h for h in handles if h is not None]

    def _batch(self, items: Sequence[BulkItem], carrier: dict[str, str] | None) -> list[JobHandle]:
        """Insert one batch in one transaction, then publish what it created."""
        connections, recorder = self.connections, self.submitter.recorder
        due = [it.new for it in items if it.new.due_now and it.new.status == s.QUEUED]
        epoch = connections.broker.submit_epoch() if due else None
        for it in items:
            it.new.trace_context = carrier
            if epoch is not None and it.new.due_now and it.new.status == s.QUEUED:
                it.new.published_epoch = epoch
        news = [it.new for it in items]
        with connections.engine.begin() as conn:
            if is_sqlite(conn):
                created = {n.id for n in news if recorder.store.insert_submitted(conn, n)}
            else:
                created = insert_batch(conn, recorder.store, news)
            existing = _existing(conn, [n for n in news if n.id not in created])
        counts: dict[str, int] = {}
        for n in news:
            if n.id in created:
                counts[n.stage] = counts.get(n.stage, 0) + 1
        for stage, count in counts.items():
            self.submitter.metrics.inc("submitted", stage, count)
        self._publish([n for n in due if n.id in created and n.published_epoch is not None], carrier)
        handles = []
        for n in news:
            if n.id in created:
                handles.append(self.submitter.handle(n.id, task_id=n.origin_task_id))
            else:
                handles.append(self.submitter.handle(existing[n.id], deduplicated=True))
        return handles

    def _publish(self, news: Sequence[NewJob], carrier: dict[str, str] | None) -> None:
        """Publish committed jobs in one pipeline; on failure leave them to the relay."""
        if not news:
            return
        connections = self.connections
        try:
            if connections.fast.down:
                raise ConnectionError("Redis did not answer a moment ago")
            outgoing = [
                Outgoing(
                    job_id=n.id,
                    stage=n.stage,
                    queue=n.queue,
                    payload=n.payload,
                    task_id=n.origin_task_id or n.id,
                    ignore_result=bool(n.options.get(s.IGNORE_RESULT)),
                )
                for n in news
            ]
            connections.broker.publish_many(outgoing, trace_context=carrier)
        except Exception as exc:
            connections.fast.trip(type(exc).__name__)
            log.info("publish of %d job(s) deferred to the relay: %s", len(news), exc)
            try:
                with connections.engine.begin() as conn:
                    ids = [n.id for n in news]
                    for start in range(0, len(ids), 1000):
                        conn.execute(
                            update(jobs)
                            .where(jobs.c.id.in_(ids[start : start + 1000]), jobs.c.status == s.QUEUED)
                            .values(published_at=None)
                        )
            except Exception:
                log.warning("could not mark %d job(s) unpublished; republish_after covers them", len(news))


def _existing(conn: Connection, news: Sequence[NewJob]) -> dict[str, str]:
    """For jobs whose insert conflicted: job id -> the id of the row holding its key."""
    if not news:
        return {}
    keys = {n.idempotency_key for n in news if n.idempotency_key is not None}
    rows = conn.execute(select(jobs.c.id, jobs.c.idempotency_key).where(jobs.c.idempotency_key.in_(keys)))
    by_key = {str(k): str(i) for i, k in rows}
    out = {}
    for n in news:
        holder = by_key.get(n.idempotency_key or "")
        if holder is None:  # lost a race with a rollback; the caller retries the whole call
            raise RuntimeError(f"job insert conflicted but no existing row was found for {n.id}")
        out[n.id] = holder
    return out


def insert_batch(conn: Connection, store: JobStore, news: Sequence[NewJob]) -> set[str]:
    """Insert jobs and their ``job.submitted`` events: the queued ones with no absolute
    time in one Postgres statement, any other one by ``store``; returns the ids inserted
    (a conflicting id or idempotency key inserts nothing)."""
    rows: list[NewJob] = []
    created: set[str] = set()
    for n in news:
        if n.status == s.QUEUED and n.run_at is None and n.expires_at is None:
            rows.append(n)
        elif store.insert_submitted(conn, n):  # never made by submit_many; kept correct
            created.add(n.id)
    if not rows:
        return created
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    params: dict[str, Any] = {
        "ids": [n.id for n in rows],
        "stages": [n.stage for n in rows],
        "queues": [n.queue for n in rows],
        "priorities": [n.priority for n in rows],
        "payloads": [dumps(n.payload) for n in rows],
        "labels": [n.label for n in rows],
        "keys": [n.idempotency_key for n in rows],
        "max_attempts": [n.max_attempts for n in rows],
        "delays": [max(0.0, float(n.delay)) for n in rows],
        "expires_in": [n.expires_in for n in rows],
        "flow_ids": [n.flow_id or n.id for n in rows],
        "parent_ids": [n.parent_id for n in rows],
        "options": [dumps(n.options) for n in rows],
        "origin_task_ids": [n.origin_task_id for n in rows],
        "epochs": [n.published_epoch for n in rows],
        "owners": [n.owner for n in rows],
        "traces": [None if n.trace_context is None else dumps(n.trace_context) for n in rows],
    }
    result = conn.execute(_statement(schema_of(conn)), params)
    created |= {str(r[0]) for r in result}
    return created


_STATEMENTS: dict[str, Any] = {}


def _statement(schema: str) -> Any:
    """The batch insert, qualified with Conveyor's schema (cached per schema)."""
    stmt = _STATEMENTS.get(schema)
    if stmt is not None:
        return stmt
    q = f'"{schema}".'
    stmt = text(
        f"""
    WITH src AS (
      SELECT * FROM unnest(
        CAST(:ids AS text[]), CAST(:stages AS text[]), CAST(:queues AS text[]),
        CAST(:priorities AS int[]), CAST(:payloads AS text[]), CAST(:labels AS text[]),
        CAST(:keys AS text[]), CAST(:max_attempts AS int[]), CAST(:delays AS float8[]),
        CAST(:expires_in AS float8[]), CAST(:flow_ids AS text[]), CAST(:parent_ids AS text[]),
        CAST(:options AS text[]), CAST(:origin_task_ids AS text[]), CAST(:epochs AS text[]),
        CAST(:owners AS text[]), CAST(:traces AS text[]))
        AS t(id, stage, queue, priority, payload, label, idempotency_key, max_attempts, delay,
             expires_in, flow_id, parent_id, options, origin_task_id, epoch, owner, trace)
    ), j AS (
      INSERT INTO {q}jobs (id, stage, queue, status, priority, payload, label, idempotency_key,
                        attempts, max_attempts, run_at, expires_at, flow_id, parent_id, options,
                        origin_task_id, created_at, updated_at, celery_task_id, published_at,
                        broker_epoch, owner, trace_context)
      SELECT id, stage, queue, 'queued', priority, CAST(payload AS json), label, idempotency_key, 0,
             max_attempts,
             CASE WHEN delay > 0 THEN clock_timestamp() + make_interval(secs => delay)
                  ELSE clock_timestamp() END,
             CASE WHEN expires_in IS NULL THEN NULL
                  ELSE clock_timestamp() + make_interval(secs => expires_in) END,
             flow_id, parent_id, CAST(options AS json), origin_task_id, clock_timestamp(),
             clock_timestamp(), CASE WHEN epoch IS NULL THEN NULL ELSE origin_task_id END,
             CASE WHEN epoch IS NULL THEN NULL ELSE clock_timestamp() END, epoch, owner,
             CAST(trace AS json)
      FROM src
      ON CONFLICT DO NOTHING
      RETURNING id, stage
    )
    INSERT INTO {q}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.submitted', json_build_object('stage', stage), clock_timestamp() FROM j
    RETURNING job_id
    """
    ).bindparams(
        *(bindparam(name, type_=ARRAY(String())) for name in _TEXT_ARRAYS),
        bindparam("priorities", type_=ARRAY(Integer())),
        bindparam("max_attempts", type_=ARRAY(Integer())),
        bindparam("delays", type_=ARRAY(Float())),
        bindparam("expires_in", type_=ARRAY(Float())),
    )
    _STATEMENTS[schema] = stmt
    return stmt


_TEXT_ARRAYS = (
    "ids",
    "stages",
    "queues",
    "payloads",
    "labels",
    "keys",
    "flow_ids",
    "parent_ids",
    "options",
    "origin_task_ids",
    "epochs",
    "owners",
    "traces",
)

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "BulkItem",
    "BulkSubmit",
    "Enqueuer",
    "check_keys",
    "indexed_invalid",
    "insert_batch",
]
