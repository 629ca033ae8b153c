"""What follows a job's end, wherever it ended: its flow carries on.

After a terminal commit, :meth:`Flow.finished` wakes the job's waiters, frees its cached
dedup key and settles its followers (:mod:`conveyor.client.followers`). A job dead-lettered
outside its body (a lost worker, a hard time limit, a follower of a dead holder) is
*buried*: its stage's ``on_dead`` hook may carry the flow on with a result, otherwise a
chord member fails its chord, as Celery would. Failures no worker reported are stored in
the result backend so ``AsyncResult.get()`` raises instead of waiting.

The runner, the reconciler and the relay call this; so does a caller's ``cancel()`` or
``submit()``, through :class:`conveyor.client.followers.Settles`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.app.task import Context
from sqlalchemy import Connection, select, update

from conveyor.client.followers import Followers
from conveyor.client.recorder import Recorder
from conveyor.client.stops import report_revoked
from conveyor.delivery.connections import Connections
from conveyor.errors import PayloadInvalid, PayloadTooLarge, PermanentError, RequeuesExhausted, WorkerLost
from conveyor.metrics import Metrics
from conveyor.stage import to_jsonable
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, is_sqlite
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import dedup_followers, jobs
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, NewJob, Row, counted_attempts, new_event
from conveyor.wire import from_wire
from conveyor.worker.continuations import Continuations, task_id_of

log = logging.getLogger("conveyor.flow")


@dataclass
class Burial:
    """A job dead-lettered outside its body, and what must follow once that commits."""

    row: Row
    state: str
    result: Any
    continuation: list[NewJob] = field(default_factory=list)
    chord_member: bool = False


class Flow:
    """Settles what hangs off a job that ended: waiters, followers, continuations, chords."""

    def __init__(
        self,
        connections: Connections,
        *,
        stages: Stages,
        store: JobStore,
        recorder: Recorder,
        continuations: Continuations,
        deduper: Deduplicator,
        followers: Followers,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.stages = stages
        self.store = store
        self.recorder = recorder
        self.continuations = continuations
        self.deduper = deduper
        self.followers = followers
        self.metrics = metrics

    def finished(self, job_id: str, status: str, *, dedup_key: str | None = None) -> None:
        """After a job's terminal transition committed: wake waiters, free its cached dedup
        key; a job cancelled or expired is reported to Celery as revoked (its chord counts it)."""
        try:
            self.connections.broker.notify(job_id, status)
            if dedup_key:
                self.deduper.release(job_id)
        except Exception:  # both are fast paths; Postgres already has the truth
            log.warning("post-terminal notification for %s failed", job_id, exc_info=True)
        if status in (s.CANCELLED, s.EXPIRED):
            report_revoked(self.connections, job_id)
        if dedup_key:
            try:
                self.resolve(job_id)
            except Exception:  # the reconciler settles them
                log.warning("could not settle followers of %s", job_id, exc_info=True)

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
                self.resolve(new.follows)  # the holder may have ended already
            elif new.rerun:
                try:
                    self.recorder.republish_if_queued(new.id)
                except Exception:  # the relay publishes it after republish_after
                    log.warning("republish of rerun job %s failed", new.id, exc_info=True)
            elif new.due_now:
                self.recorder.publish_new(new)

    # -- followers --------------------------------------------------------------------------

    def resolve(self, holder: str) -> int:
        """Settle every follower of ``holder`` if the holder is terminal (or gone)."""
        with reading(self.connections.engine) as conn:
            row = self.store.get(conn, holder)
            if row is not None and row["status"] not in s.TERMINAL:
                return 0
            ids = self.followers.waiting_on(conn, holder)
        settled = 0
        for job_id in ids:
            try:
                settled += self._settle(job_id, holder, row)
            except Exception:  # the reconciler settles it on a later pass
                log.warning("could not settle follower %s of %s", job_id, holder, exc_info=True)
        return settled

    def _settle(self, job_id: str, holder: str, holder_row: Row | None) -> int:
        status = None if holder_row is None else str(holder_row["status"])
        burial: Burial | None = None
        continuation: list[NewJob] = []
        requeued = False
        with self.connections.engine.begin() as conn:
            q = select(jobs).where(jobs.c.id == job_id, jobs.c.status == s.WAITING_DEDUP)
            if not is_sqlite(conn):
                q = q.with_for_update(skip_locked=True)
            row = conn.execute(q).mappings().one_or_none()
            if row is None:
                return 0
            if status in (s.SUCCEEDED, s.SKIPPED):
                assert holder_row is not None
                result = holder_row["result"]
                self.store.finish(
                    conn,
                    row,
                    s.SUCCEEDED,
                    from_status=(s.WAITING_DEDUP,),
                    topic="job.succeeded",
                    body={"deduplicated_into": holder},
                )
                conn.execute(update(jobs).where(jobs.c.id == job_id).values(result=result))
                continuation = self._continue(conn, row, result)
            elif status in (s.DEAD, None):
                cause = "no longer exists" if holder_row is None else f"died: {holder_row['last_error']}"
                message = f"deduplicated into job {holder}, which {cause}"[:2000]
                burial = self.bury(
                    conn, row, error=PermanentError(message), message=message, from_status=(s.WAITING_DEDUP,)
                )
            else:
                requeued = self._take_over(conn, row, holder)
        if burial is not None:
            self.after_burial(burial)
        elif continuation or status in (s.SUCCEEDED, s.SKIPPED):
            assert holder_row is not None
            self.publish_continuations(continuation)
            self.count_in_chord(row, "SUCCESS", holder_row["result"])
            self._store_result(row, holder_row["result"])
            self.finished(job_id, s.SUCCEEDED, dedup_key=row["dedup_key"])
        elif requeued:
            self.recorder.republish_if_queued(job_id)
        return 1

    def _continue(self, conn: Connection, row: Row, result: Any) -> list[NewJob]:
        """The follower's flow goes on with the holder's result, as if it had run."""
        options = row["options"] or {}
        task_id = row["origin_task_id"] or row["id"]
        extra = {"parent_id": task_id, "root_id": options.get("root_id") or task_id}
        created, _, _ = self.continuations.next_jobs(
            options.get("chain") or [], options.get("link") or [], row, result, extra
        )
        return self.continuations.insert(conn, created, upstream=str(row["id"]))

    def _take_over(self, conn: Connection, row: Row, holder: str) -> bool:
        """The holder was cancelled or expired: the follower takes the dedup id and runs,
        or follows the live job that took it meanwhile. True when it was queued to run."""
        spec = self.stages.get(row["stage"])
        mode = spec.dedup.mode if spec is not None and spec.dedup is not None else "simple"
        other = None
        if row["dedup_key"]:
            other = self.deduper.retake(
                conn, row["dedup_key"], str(row["id"]), now=self.deduper.clock(), mode=mode
            )
        if other is not None:
            conn.execute(
                update(dedup_followers).where(dedup_followers.c.job_id == row["id"]).values(holder=other)
            )
            body = {"stage": row["stage"], "holder": other, "previous_holder": holder}
            self.store.emit(conn, [new_event(row["id"], "job.following", body)])
            return False
        conn.execute(
            update(jobs)
            .where(jobs.c.id == row["id"], jobs.c.status == s.WAITING_DEDUP)
            .values(status=s.QUEUED, run_at=db_now(), published_at=None, updated_at=db_now())
        )
        body = {"stage": row["stage"], "previous_holder": holder, "holder_status": "ended without a result"}
        self.store.emit(conn, [new_event(row["id"], "job.queued", body)])
        return True

    def _store_result(self, row: Row, result: Any) -> None:
        """An ``AsyncResult`` of the follower's task id sees the holder's result."""
        origin = row["origin_task_id"]
        if not origin or not s.wants_celery_result(row):
            return
        try:
            self.connections.app.backend.store_result(origin, from_wire(result), "SUCCESS")
        except Exception:
            log.warning("could not store the result of follower %s", row["id"], exc_info=True)

    # -- burials ----------------------------------------------------------------------------

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
            own = task_id_of(row)
            extra = {"parent_id": own, "root_id": options.get("root_id") or own}
            created, _, _ = self.continuations.next_jobs(
                options.get("chain") or [], options.get("link") or [], row, result, extra
            )
            burial.continuation = self.continuations.insert(conn, created, upstream=str(row["id"]))
            burial.state, burial.result = "SUCCESS", result
        else:
            # Its stage errbacks run as jobs, as after a body's failure (plain tasks are not
            # called: no worker holds a request of this job to call them with).
            created, _ = self.continuations.errback_jobs(options.get("link_error") or [], row, error)
            burial.continuation = self.continuations.insert(conn, created, upstream=str(row["id"]))
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

    def record_expired(self, conn: Connection, row: Row) -> None:
        """A job expired (the sweep, or the claim that found it late): let the stage record
        it (``on_expired``), in a savepoint of the expiring transaction, so a failing hook
        never undoes the expiry nor stops the sweep's other jobs."""
        spec = self.stages.get(row["stage"])
        if spec is None or spec.on_expired is None:
            return
        payload = row.get("payload")
        if payload is None:  # a partial row: the payload is the hook's to read
            payload = conn.execute(select(jobs.c.payload).where(jobs.c.id == row["id"])).scalar_one()
        try:
            with conn.begin_nested():
                spec.on_expired(conn, payload)
        except Exception:
            log.error("on_expired hook of %s failed for %s", row["stage"], row["id"], exc_info=True)

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

    def bury_lost(self, job: Row, *, requeues: bool = False) -> None:
        """The last attempt's worker died, or the job was requeued uncounted too often:
        dead-letter it, and carry on its flow."""
        if requeues:
            message = (
                f"infrastructure kept failing: requeued {job['requeues']} times without counting "
                f"an attempt (limit {self.store.max_requeues}); giving up"
            )
            error: BaseException = RequeuesExhausted(message)
        else:
            message = (
                f"the worker running attempt {counted_attempts(job)} of {job['max_attempts']} "
                "died (crash, OOM or kill); giving up"
            )
            error = WorkerLost(message)
        with self.connections.engine.begin() as conn:
            burial = self.bury(conn, job, error=error, message=message)
        self.after_burial(burial)

    def requeue_uncounted(self, job_id: str, attempt: int | None, owner: str, reason: str) -> str:
        """Requeue an attempt stopped by an outage or a shutdown without counting it; past
        ``max_requeues`` dead-letter the job ("infrastructure kept failing") instead.

        Returns ``"released"``, ``"exhausted"`` (dead-lettered) or ``"refused"`` (the
        attempt no longer owns the job: it finished, or was taken over). Raises when the
        database is out of reach (:meth:`conveyor.worker.heartbeat.Heartbeat.requeue_uncounted`
        retries it later).
        """
        with self.connections.engine.begin() as conn:
            outcome = self.store.release_uncounted(conn, job_id, attempt, owner, reason)
            row = self.store.get(conn, job_id) if outcome == "exhausted" else None
        if row is not None:
            self.bury_lost(row, requeues=True)
        return outcome

    # -- the result backend -------------------------------------------------------------------

    def report_failure(self, task_id: str, options: Mapping[str, Any], error: BaseException) -> None:
        """Store a failure no worker reported (a burial, a link that could never run) in
        the result backend, for the task and the rest of its chain, as Celery does for a
        task that raised: ``AsyncResult.get()`` raises instead of waiting forever. Chord
        counting is the caller's (``count_in_chord``)."""
        request = Context(id=task_id, chain=options.get("chain"), root_id=options.get("root_id"))
        try:
            self.connections.app.backend.mark_as_failure(task_id, error, request=request, call_errbacks=False)
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
            self.connections.app.backend.on_chord_part_return(request, state, from_wire(result))
        except Exception:
            log.warning("could not count job %s in its chord", row["id"], exc_info=True)


__all__ = ["Burial", "Flow"]
