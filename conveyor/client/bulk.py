"""Bulk submit: ``submit_many()`` records many jobs in a few transactions and publishes
them through one pipelined Redis call per batch.

The caller's side (the platform's :class:`conveyor.client.submit.Submitter` and the web app's
:class:`conveyor.client.by_name.Client`) validates every payload and builds each job exactly as
``submit()`` does; :class:`BulkSubmit` then records them:

* Jobs whose stage has a dedup policy (or that the call gives one) go through
  ``submit()``'s own path, one by one (:meth:`Submitter.enqueue`): the dedup decision
  (cache, ``dedup_keys`` row, followers, debounce) is per job and cannot be made for a
  whole batch at once without changing what it answers.
* Every other job is inserted ``batch_size`` at a time: on Postgres one
  ``INSERT ... SELECT FROM json_to_recordset(...) ON CONFLICT DO NOTHING`` that writes
  each row and its ``job.submitted`` event, one synchronous transaction per batch; on
  SQLite a loop of the ordinary inserts in one transaction per batch. The rows of jobs due
  now are inserted as already published under the current broker epoch (as ``submit()``'s
  are); once the batch has committed its messages go out through one pipeline
  (:meth:`conveyor.delivery.broker.Broker.publish_many`). If Redis is away (no epoch) the rows are
  inserted unpublished; if the publish fails they are marked unpublished: either way the
  relay publishes them (and ``republish_after`` covers a mark that failed too).
* On Postgres, a batch with no idempotency key (nothing in it can conflict) commits on a
  helper thread while this thread builds its messages, which are sent only once it has
  committed (never if it failed); the next batch's commit starts as soon as this one's
  returned, while its messages are sent. A batch with keys commits first, then publishes
  only the jobs it created.

Idempotency keys are honoured as ``submit()`` honours them: a key recorded before returns
the existing job's handle with ``deduplicated=True``, and a key given twice in one call
records the first job only, the later ones getting its handle with ``deduplicated=True``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.trace import SpanKind
from sqlalchemy import Connection, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from conveyor import tracing
from conveyor.client.handle import JobHandle
from conveyor.client.recorder import Recorder
from conveyor.dedup import DedupPlan
from conveyor.delivery.broker import Outgoing
from conveyor.delivery.connections import Connections
from conveyor.errors import PayloadInvalid, SubmitFailed, describe
from conveyor.metrics import Metrics
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import is_sqlite
from conveyor.store.db.namespace import schema_of
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import JobStore, NewJob

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


@dataclass
class _Prepared:
    """A batch stamped for its insert; ``future`` is its commit when it runs on the helper."""

    items: Sequence[BulkItem]
    news: list[NewJob]
    sent: list[NewJob]
    future: Future[tuple[set[str], dict[str, str]]] | None


class Enqueuer(Protocol):
    """What :class:`BulkSubmit` uses of a :class:`conveyor.client.submit.Submitter`."""

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
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: _Prepared | None = None  # the next batch, its commit under way

    def run(self, items: Sequence[BulkItem], *, batch_size: int = DEFAULT_BATCH_SIZE) -> list[JobHandle]:
        """Record ``items`` (see the module's docstring); their handles in the same order.

        Raises :class:`conveyor.errors.SubmitFailed` if the database fails: the batches
        committed before it stay recorded, so retry the call with the same idempotency keys.
        Jobs with a dedup plan are recorded after the batches, one by one.
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
        with tracing.span("conveyor.submit_many", attributes=attributes, kind=SpanKind.PRODUCER):
            carrier = tracing.carrier()
            done = 0
            try:
                chunks = list(batches(plain, batch_size))
                groups = [[items[i] for i in chunk] for chunk in chunks]
                for k, chunk in enumerate(chunks):
                    upcoming = groups[k + 1] if k + 1 < len(groups) else None
                    for i, handle in zip(chunk, self._batch(groups[k], carrier, upcoming), strict=True):
                        handles[i] = handle
                    done += len(chunk)
            except (DBAPIError, PoolTimeout) as exc:
                raise SubmitFailed(
                    f"could not record a batch of jobs: {describe(exc)}; {done} of {len(items)} were "
                    "recorded before it (the failing batch may have committed if the connection died "
                    "while committing): retry with the same idempotency keys"
                ) from exc
            finally:
                self._ahead = None
                if self._pool is not None:
                    self._pool.shutdown()
                    self._pool = None
            for i in planned:
                handles[i] = self.submitter.enqueue(items[i].new, session=None, plan=items[i].plan)
        for i, j in repeats:
            held = handles[j]
            assert held is not None
            handles[i] = self.submitter.handle(held.id, deduplicated=True)
        done_handles = [h for h in handles if h is not None]
        assert len(done_handles) == len(items)
        return done_handles

    def _batch(
        self, items: Sequence[BulkItem], carrier: dict[str, str] | None, upcoming: Sequence[BulkItem] | None
    ) -> list[JobHandle]:
        """Insert one batch in one transaction, then publish what it created.

        When no job of the batch can conflict (no idempotency key: ids are fresh UUIDs) on
        Postgres, the commit runs on a helper thread while this one builds the messages;
        they are sent only once it committed, and not at all if it failed. As soon as it
        committed, the ``upcoming`` batch's commit starts on the helper, while this one's
        messages are sent.
        """
        ahead = self._ahead
        if ahead is not None and ahead.items is items:
            self._ahead = None
        else:
            ahead = self._prepare(items, carrier)
        news, sent, future = ahead.news, ahead.sent, ahead.future
        if future is not None:

            def committed() -> None:
                future.result()  # raises the database's error
                self._start(upcoming, carrier)

            self._publish(sent, carrier, committed=committed)
            created, existing = future.result()
        else:
            created, existing = self._commit(news)
            self._publish([n for n in sent if n.id in created], carrier)
        counts: dict[str, int] = {}
        for n in news:
            if n.id in created:
                counts[n.stage] = counts.get(n.stage, 0) + 1
        for stage, count in counts.items():
            self.submitter.metrics.inc("submitted", stage, count)
        handles = []
        for n in news:
            if n.id in created:
                handles.append(self.submitter.handle(n.id, task_id=n.origin_task_id))
            else:
                handles.append(self.submitter.handle(existing[n.id], deduplicated=True))
        return handles

    def _prepare(self, items: Sequence[BulkItem], carrier: dict[str, str] | None) -> _Prepared:
        """Stamp a batch's jobs (trace, and the epoch they are published under if due now)
        and, when it cannot conflict on Postgres, start its commit on the helper thread."""
        connections = self.connections
        due = [it.new for it in items if it.new.due_now and it.new.status == s.QUEUED]
        epoch = connections.broker.submit_epoch() if due else None
        for it in items:
            it.new.trace_context = carrier
            if epoch is not None and it.new.due_now and it.new.status == s.QUEUED:
                it.new.published_epoch = epoch
        news = [it.new for it in items]
        sent = [n for n in due if n.published_epoch is not None]
        overlap = (
            bool(sent)
            and not connections.fast.down
            and not is_sqlite(connections.engine)
            and all(n.idempotency_key is None for n in news)
        )
        future = self._helper().submit(self._commit, news, batch_rows(news)) if overlap else None
        return _Prepared(items, news, sent, future)

    def _start(self, upcoming: Sequence[BulkItem] | None, carrier: dict[str, str] | None) -> None:
        """Prepare the next batch (its commit starts if it can) unless done already."""
        if upcoming is not None and self._ahead is None:
            self._ahead = self._prepare(upcoming, carrier)

    def _helper(self) -> ThreadPoolExecutor:
        """The thread that commits a batch while its messages are built (one per call)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-bulk")
        return self._pool

    def _commit(self, news: Sequence[NewJob], rows: Rows | None = None) -> tuple[set[str], dict[str, str]]:
        """Insert ``news`` in one transaction: the ids created, and for the others the id
        of the job holding their idempotency key."""
        with self.connections.engine.begin() as conn:
            if is_sqlite(conn):
                store = self.submitter.recorder.store
                created = {n.id for n in news if store.insert_submitted(conn, n)}
            else:
                created = insert_batch(conn, self.submitter.recorder.store, rows or batch_rows(news))
            return created, _existing(conn, [n for n in news if n.id not in created])

    def _publish(
        self,
        news: Sequence[NewJob],
        carrier: dict[str, str] | None,
        *,
        committed: Callable[[], None] | None = None,
    ) -> None:
        """Publish jobs in one pipeline once committed (``committed`` waits for that, and
        raises the database's error: then nothing is sent and it propagates); if Redis
        fails, leave them to the relay."""
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
            connections.broker.publish_many(outgoing, trace_context=carrier, ready=committed)
        except Exception as exc:
            if committed is not None:
                committed()  # the database's own error, if any, wins: nothing was recorded
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


@dataclass
class Rows:
    """A batch as it is inserted: one JSON document of its queued jobs with no absolute
    time (None: there are none), and its other jobs (never made by ``submit_many``)."""

    document: str | None
    others: list[NewJob]
    count: int
    fresh: list[str] | None = None  # the document's ids when none can conflict


def batch_rows(news: Sequence[NewJob]) -> Rows:
    """``news`` as :func:`insert_batch` takes them. One JSON document (the C encoder)
    rather than one array per column (psycopg dumps those element by element in Python),
    made by the caller's thread, not the one that commits."""
    records: list[dict[str, Any]] = []
    others: list[NewJob] = []
    for n in news:
        if n.status != s.QUEUED or n.run_at is not None or n.expires_at is not None:
            others.append(n)
            continue
        records.append(
            {
                "id": n.id,
                "stage": n.stage,
                "queue": n.queue,
                "priority": n.priority,
                "payload": n.payload,
                "label": n.label,
                "idempotency_key": n.idempotency_key,
                "max_attempts": n.max_attempts,
                "delay": n.delay if n.delay > 0 else None,
                "expires_in": n.expires_in,
                "flow_id": n.flow_id or n.id,
                "parent_id": n.parent_id,
                "options": n.options,
                "origin_task_id": n.origin_task_id,
                "epoch": n.published_epoch,
                "owner": n.owner,
                "trace": n.trace_context,
            }
        )
    fresh = [str(r["id"]) for r in records] if all(r["idempotency_key"] is None for r in records) else None
    return Rows(_dumps(records) if records else None, others, len(news), fresh)


def insert_batch(conn: Connection, store: JobStore, rows: Rows) -> set[str]:
    """Insert a batch's jobs and their ``job.submitted`` events (the document's in one
    Postgres statement, any other one by ``store``); returns the ids inserted (a
    conflicting id or idempotency key inserts nothing)."""
    created = {n.id for n in rows.others if store.insert_submitted(conn, n)}
    if rows.document is None:
        return created
    statement = _statement(schema_of(conn), rows.fresh is not None)
    result = conn.execute(statement, {"rows": rows.document})
    if rows.fresh is None:
        return created | {str(r[0]) for r in result}
    inserted = int(result.scalar_one())
    if inserted != len(rows.fresh):  # a fresh UUID taken: never; the caller retries the call
        raise RuntimeError(f"{len(rows.fresh) - inserted} fresh job id(s) conflicted")
    return created | set(rows.fresh)


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


_STATEMENTS: dict[tuple[str, bool], Any] = {}


def _statement(schema: str, counted: bool) -> Any:
    """The batch insert, qualified with Conveyor's schema (cached). It returns the ids
    inserted, or with ``counted`` only how many (no row can conflict: every id is fresh
    and no job has an idempotency key; both sides skip a thousand-row result)."""
    stmt = _STATEMENTS.get((schema, counted))
    if stmt is not None:
        return stmt
    q = f'"{schema}".'
    stmt = text(
        f"""
    WITH src AS (
      SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS t(
        id text, stage text, queue text, priority int, payload json, label text,
        idempotency_key text, max_attempts int, delay float8, expires_in float8, flow_id text,
        parent_id text, options json, origin_task_id text, epoch text, owner text, trace json)
    ), j AS (
      INSERT INTO {q}jobs (id, stage, queue, status, priority, payload, label, idempotency_key,
                        attempts, max_attempts, run_at, expires_at, flow_id, parent_id, options,
                        origin_task_id, created_at, updated_at, celery_task_id, published_at,
                        broker_epoch, owner, trace_context)
      SELECT id, stage, queue, 'queued', priority, payload, label, idempotency_key, 0,
             max_attempts,
             CASE WHEN delay IS NULL THEN clock_timestamp()
                  ELSE clock_timestamp() + make_interval(secs => delay) END,
             CASE WHEN expires_in IS NULL THEN NULL
                  ELSE clock_timestamp() + make_interval(secs => expires_in) END,
             flow_id, parent_id, options, origin_task_id, clock_timestamp(),
             clock_timestamp(), CASE WHEN epoch IS NULL THEN NULL ELSE origin_task_id END,
             CASE WHEN epoch IS NULL THEN NULL ELSE clock_timestamp() END, epoch, owner,
             trace
      FROM src
      ON CONFLICT DO NOTHING
      RETURNING id, stage
    ){"," if counted else ""}
    {"e AS (" if counted else ""}
    INSERT INTO {q}job_events (job_id, topic, body, created_at)
    SELECT id, 'job.submitted', json_build_object('stage', stage), clock_timestamp() FROM j
    RETURNING job_id
    {") SELECT count(*) FROM e" if counted else ""}
    """
    )
    _STATEMENTS[(schema, counted)] = stmt
    return stmt


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "BulkItem",
    "BulkSubmit",
    "Enqueuer",
    "Rows",
    "batch_rows",
    "check_keys",
    "indexed_invalid",
    "insert_batch",
]
