"""The relay publishes what Postgres says is due; the reconciler repairs what was lost.

Both run in one background thread of every worker (and of ``conveyor up``); an advisory
lock makes sure only one process in the cluster does the work at a time. The reconciler's
half of a pass is :mod:`conveyor.upkeep.reconciler`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from typing import Any

from sqlalchemy import and_, func, or_, select

from conveyor.client.dlq import DeadLetterQueue
from conveyor.delivery.connections import Connections
from conveyor.errors import DatabaseBusy
from conveyor.logs import RepeatedFailure
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus, try_singleton_lock
from conveyor.store.db.engine import brief_write
from conveyor.store.db.schema import jobs
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.events import sequence_events
from conveyor.store.jobs import JobStore, new_event
from conveyor.store.liveness import Deliveries, Orphan, note_tick
from conveyor.upkeep.reconciler import BATCH, Reconciler, TickReport
from conveyor.worker.flow import Flow

log = logging.getLogger("conveyor.relay")

RELAY_LOCK = 0x636F6E76  # "conv"
# Clocks of a worker host and of the database differ a little: widen the dying window.
DYING_MARGIN = 2.0
# How long a pass waits for SQLite's writer before skipping (Postgres: no limit).
RELAY_WAIT = 0.5
# The shortest sleep between passes when a job falls due sooner than the next one.
MIN_WAIT = 0.02


class Relay:
    """Publishes due jobs, republishes lost ones, requeues stalled ones, expires, purges."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        flow: Flow,
        reconciler: Reconciler,
        deliveries: Deliveries,
        deduper: Deduplicator,
        dlq: DeadLetterQueue | None = None,
    ) -> None:
        self.connections = connections
        self._epoch_failures = RepeatedFailure(
            log, "reading the broker epoch (Redis or RabbitMQ unreachable: reconciling in the database only)"
        )
        self.dlq = dlq  # with the stages' hooks: performs the retries clients requested
        self.store = store
        self.flow = flow
        self.reconciler = reconciler
        self.deliveries = deliveries
        self.deduper = deduper
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_reconcile = 0.0
        self._last_unclaimed = float("-inf")

    # -- one pass -----------------------------------------------------------------------

    def tick(self, *, reconcile: bool = True) -> TickReport:
        """One pass of the relay (and the reconciler); safe to call from anywhere.

        On SQLite a pass never queues behind a long transaction (a stage body holding the
        single writer): it is skipped (``skipped_busy``) and the next one tries again.
        """
        try:
            return self._tick(reconcile=reconcile)
        except DatabaseBusy:
            log.debug("relay pass skipped: the SQLite writer is busy")
            return TickReport(skipped_busy=True)

    def _tick(self, *, reconcile: bool) -> TickReport:
        connections = self.connections
        report = TickReport()
        self.reconciler.begin()
        settings = connections.settings
        # The pass clock first, in a transaction of its own: it measures whether the
        # *database* was reachable (leases are renewed there), so a Redis outage that fails
        # the rest of this pass must not read as a gap.
        with brief_write(connections.engine, RELAY_WAIT) as conn:
            if not try_singleton_lock(conn, RELAY_LOCK, settings.resolved_home()):
                report.skipped_lock = True
                return report
            note_tick(conn, gap=max(3 * settings.relay_interval, 2 * settings.heartbeat_interval))
        try:
            epoch: str | None = connections.broker.epoch(max_age=0)
        except Exception as exc:
            if not reconcile:
                raise
            # Redis (or RabbitMQ) is unreachable: still repair stalls and expiry in the
            # database; what this requeues is published as soon as both answer again.
            self._epoch_failures.failed(exc, time.monotonic())
            epoch = None
        else:
            self._epoch_failures.passed()
        orphans = self.deliveries.orphans() if reconcile and epoch is not None else {}
        with brief_write(connections.engine, RELAY_WAIT) as conn:
            if not try_singleton_lock(conn, RELAY_LOCK, settings.resolved_home()):
                report.skipped_lock = True
                return report
            # Reconcile first: a job it requeues is published in this very pass.
            finished = (
                self.reconciler.reconcile(conn, report, redis_up=epoch is not None) if reconcile else []
            )
            marked = (
                self._mark_publishable(conn, epoch, orphans, reconcile=reconcile) if epoch is not None else []
            )
            report.next_due = next_due(conn) if epoch is not None else None
        sequence_events(connections.engine)  # keeps readers' own sequencer passes small
        for job_id, status, dedup_key in finished:
            self.flow.finished(job_id, status, dedup_key=dedup_key)
        if epoch is None:
            return report
        for worker in orphans:
            self.deliveries.forget(worker)
        self._copy_dedup_events()
        self.reconciler.after_commit()
        if reconcile and self.dlq is not None:
            report.retried = self.dlq.run_requested()
        for row, task_id in marked:
            self._publish(row, task_id)
        report.published = sum(1 for r, _ in marked if r["published_at"] is None)
        report.republished = len(marked) - report.published
        return report

    def _mark_publishable(
        self, conn: Any, epoch: str, orphans: dict[str, Orphan], *, reconcile: bool
    ) -> list[tuple[Any, str]]:
        """Due jobs and jobs whose message was lost, each marked published under ``epoch``
        with a fresh task id (published after commit)."""
        due = (
            conn.execute(
                select(jobs)
                .where(
                    jobs.c.status.in_(s.CLAIMABLE),
                    jobs.c.published_at.is_(None),
                    jobs.c.run_at <= db_now(),
                )
                .order_by(jobs.c.priority.desc(), jobs.c.run_at)
                .limit(BATCH)
            )
            .mappings()
            .all()
        )
        # A wiped broker: everything published under another epoch, exactly once per epoch.
        published = _published_waiting()
        # ``<`` or ``>``, not ``<>``: ranges of ix_jobs_published_epoch (migration 0017), so
        # a pass that finds nothing reads no row of the backlog.
        other_epoch = or_(
            jobs.c.broker_epoch.is_(None), jobs.c.broker_epoch < epoch, jobs.c.broker_epoch > epoch
        )
        earlier = list(conn.execute(select(jobs).where(published, other_epoch).limit(BATCH)).mappings())
        if earlier:
            log.info("republishing %d job(s) published before broker epoch %s", len(earlier), epoch)
        lost = [
            *earlier,
            *(self._unclaimed_too_long(conn, epoch) if reconcile and self._unclaimed_due() else []),
            *self._taken_by_dead_workers(conn, orphans, epoch=epoch, seen={r["id"] for r in due}),
        ]
        unique = {r["id"]: r for r in [*due, *lost]}  # one message per job per pass
        return [
            (row, task_id)
            for row in unique.values()
            if (task_id := self.store.mark_for_publish(conn, row, epoch=epoch)) is not None
        ]

    def _unclaimed_too_long(self, conn: Any, epoch: str) -> list[Any]:
        """Jobs published under this epoch more than ``republish_after`` ago and still not
        claimed, *if their queue holds fewer messages than it has waiting jobs*.

        A long backlog is not a lost message: republishing every old job each period would
        multiply the backlog (and every copy costs a claim). A queue short of messages has
        lost some; the oldest waiting jobs get one more message each, up to the shortfall,
        so the broker never holds much more than one message per waiting job.
        """
        old = jobs.c.published_at < db_now_plus(-self.connections.settings.republish_after)
        waiting = _waiting_under(epoch)
        stale = [str(q) for q in conn.execute(select(jobs.c.queue).where(waiting, old).distinct()).scalars()]
        rows: list[Any] = []
        for queue, short in self._shortfall(conn, epoch, stale).items():
            q = select(jobs).where(waiting, old, jobs.c.queue == queue)
            found = list(conn.execute(q.order_by(jobs.c.published_at).limit(short)).mappings())
            if found:
                log.warning(
                    "queue %s holds %d message(s) fewer than it has jobs waiting: republishing "
                    "the %d oldest (lost messages: a deleted queue, a broker that lost them)",
                    queue,
                    short,
                    len(found),
                )
            rows += found
        return rows

    def _unclaimed_due(self) -> bool:
        """The unclaimed-too-long check counts a queue's whole backlog: run it four times
        per ``republish_after`` (its resolution), not every reconciler pass."""
        now = time.monotonic()
        if now - self._last_unclaimed < self.connections.settings.republish_after / 4:
            return False
        self._last_unclaimed = now
        return True

    def _shortfall(self, conn: Any, epoch: str, queues: list[str]) -> dict[str, int]:
        """Per queue: how many more jobs wait (published under ``epoch``, unclaimed) than
        the broker holds messages; only queues that are short, capped at a batch."""
        if not queues:
            return {}
        counts = conn.execute(
            select(jobs.c.queue, func.count())
            .where(_waiting_under(epoch), jobs.c.queue.in_(queues))
            .group_by(jobs.c.queue)
        ).all()
        messages = self.connections.broker.message_counts(queues)
        short = {str(q): min(int(n) - messages.get(str(q), 0), BATCH) for q, n in counts}
        return {q: n for q, n in short.items() if n > 0}

    def _taken_by_dead_workers(
        self, conn: Any, orphans: dict[str, Orphan], *, epoch: str, seen: set[str]
    ) -> list[Any]:
        """Jobs whose message a dead worker may have taken and never claimed, still queued
        and published, marked for publish again at once:

        * the ones it recorded as delivered to it (a message merely waiting in a long queue
          has no delivery record, so it is never copied);
        * the ones published while it was dying: a SIGKILLed process's sockets stay open
          for a moment, and Redis answers its pending BRPOP with the next message pushed,
          which then vanishes with it before anything is recorded. Copied once per dead
          worker, only for that window, and only as many per queue as the queue is short
          of messages (a backlog published in the window is still in the queue).
        """
        if not orphans:
            return []
        published = _published_waiting()
        ids = sorted({j for o in orphans.values() for j in o.delivered} - seen)
        rows = list(conn.execute(select(jobs).where(jobs.c.id.in_(ids), published)).mappings()) if ids else []
        beat = self.deliveries.beat_interval
        in_window: dict[str, Any] = {}
        for orphan in orphans.values():
            start = dt.datetime.fromtimestamp(orphan.last_beat - DYING_MARGIN, dt.UTC)
            end = dt.datetime.fromtimestamp(orphan.last_beat + beat + DYING_MARGIN, dt.UTC)
            window = and_(published, jobs.c.published_at >= start, jobs.c.published_at <= end)
            q = select(jobs).where(window).order_by(jobs.c.published_at).limit(BATCH)
            in_window.update({r["id"]: r for r in conn.execute(q).mappings()})
        short = self._shortfall(conn, epoch, sorted({str(r["queue"]) for r in in_window.values()}))
        for row in in_window.values():
            if short.get(row["queue"], 0) > 0:
                short[row["queue"]] -= 1
                rows.append(row)
        unique = {r["id"]: r for r in rows if r["id"] not in seen}
        if unique:
            log.info("republishing %d job(s) of dead worker(s) %s", len(unique), ", ".join(orphans))
        return list(unique.values())

    def _copy_dedup_events(self) -> None:
        """Move fast-path dedup events from their Redis stream into the outbox.

        At-least-once: entries are deleted from the stream only after the outbox commit.
        """
        r = self.connections.redis
        entries: list[Any] = list(r.xrange(self.deduper.stream, count=BATCH) or [])
        if not entries:
            return
        events = []
        for _, fields in entries:
            f = {_text(k): _text(v) for k, v in (fields or {}).items()}
            body = {
                "stage": f.get("stage"),
                "dedup_id": f.get("dedup"),
                "existing_job": f.get("job"),
                "fast_path": True,
            }
            events.append(new_event(f.get("job"), "job.deduplicated", body))
        with self.connections.engine.begin() as conn:
            self.store.emit(conn, events)
        r.xdel(self.deduper.stream, *[_text(eid) for eid, _ in entries])

    def _publish(self, row: Any, task_id: str) -> None:
        try:
            self.connections.broker.publish(
                stage=row["stage"],
                job_id=row["id"],
                queue=row["queue"],
                payload=row["payload"],
                options=row["options"] or {},
                task_id=task_id,
                trace_context=row.get("trace_context"),
            )
        except Exception:
            # Marked as published under this epoch; the republish_after rule retries it.
            log.warning("relay could not publish job %s", row["id"], exc_info=True)

    # -- background thread --------------------------------------------------------------

    def start(self) -> None:
        """Run passes every ``relay_interval`` in a daemon thread."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="conveyor-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits for the current pass)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        settings = self.connections.settings
        failures = RepeatedFailure(log, "relay pass")
        wait = settings.relay_interval
        while not self._stop.wait(wait):
            wait = settings.relay_interval
            now = time.monotonic()
            reconcile = now - self._last_reconcile >= settings.reconciler_interval
            outcome = "failed"
            try:
                report = self.tick(reconcile=reconcile)
                outcome = "busy" if report.skipped_busy else "ok"
                if report.next_due is not None:
                    # A job due before the next pass: wake for it, so its start lags its
                    # due time by a publish, not by up to a whole interval.
                    wait = min(wait, max(MIN_WAIT, report.next_due))
                if reconcile and not report.skipped_busy:
                    self._last_reconcile = now
                failures.passed()
            except Exception as exc:  # an outage must not kill the thread; the next pass retries
                failures.failed(exc, now)
            self._note_pass(outcome)

    def _note_pass(self, outcome: str) -> None:
        """Record in Redis that this relay thread made a pass (monitoring: it is alive
        and not stuck behind a lock), whether the pass did its work or not."""
        connections = self.connections
        try:
            value = json.dumps({"at": time.time(), "outcome": outcome, "pid": os.getpid()})
            connections.redis.set(f"{connections.settings.key_prefix}relay:pass", value, ex=300)
        except Exception:  # Redis down: nothing to record it in
            log.debug("could not record the relay pass", exc_info=True)


def next_due(conn: Any) -> float | None:
    """Seconds until the earliest unpublished job waiting to be claimed falls due (the
    database's clock), or None when there is none."""
    row = conn.execute(
        select(func.min(jobs.c.run_at), db_now()).where(
            jobs.c.status.in_(s.CLAIMABLE), jobs.c.published_at.is_(None), jobs.c.run_at > db_now()
        )
    ).first()
    if row is None or row[0] is None:
        return None
    # Both are the Timestamp type's: aware UTC datetimes on Postgres and SQLite alike.
    due, now = row[0], row[1]
    return max(0.0, float((due - now).total_seconds()))


def _published_waiting() -> Any:
    """Jobs waiting to be claimed whose message was published (under any epoch)."""
    return and_(jobs.c.status.in_(s.CLAIMABLE), jobs.c.published_at.is_not(None))


def _waiting_under(epoch: str) -> Any:
    """Jobs waiting to be claimed whose message was published under ``epoch``."""
    return and_(_published_waiting(), jobs.c.broker_epoch == epoch)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["Relay", "TickReport", "next_due"]
