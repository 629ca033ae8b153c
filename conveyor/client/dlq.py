"""The dead-letter queue: list, show, retry one, retry all, purge.

A retry runs the stage's ``on_retry`` hook, which is deployment code. The deployment's
platform (``conveyor dlq retry``) has it. A client (the HTTP API) has only the stage
registry: it retries a stage whose row says it has no hook, from the row's attempt budget
and dedup mode, and refuses any other (:class:`RetryNeedsDeployment`) rather than skip a
hook, since a skipped hook would leave ``on_dead``'s record in place.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, func, select, update
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import DBAPIError

from conveyor.client.recorder import Recorder
from conveyor.client.registry import RegisteredStage
from conveyor.dedup import PLAN_OPTION, Dedup, DedupPlan, Reuse
from conveyor.delivery.connections import Connections
from conveyor.errors import ConfigurationError, RetryNeedsDeployment, RetryRefused, UnknownStage
from conveyor.stage import StageSpec
from conveyor.stages import Stages
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import dead_letters, jobs
from conveyor.store.dedup_keys import Deduplicator
from conveyor.store.jobs import JobStore, new_event

log = logging.getLogger("conveyor.dlq")


@dataclass
class DeadLetterPage:
    """One page of open dead letters."""

    items: list[RowMapping]
    total: int
    page: int
    per_page: int


@dataclass(frozen=True)
class _Rerun:
    """How a dead job is run again: its new attempt budget, its stage's dedup policy and hook."""

    max_attempts: int
    dedup: Dedup | None
    on_retry: Callable[[Any, Any], None] | None


class DeadLetterQueue:
    """Operations on ``dead_letters``; retries go back through the relay.

    ``registered`` (a client's): the stage registry's row of a stage, used instead of the
    stage's code, so a retry needs no deployment code (see the module's docstring).
    """

    def __init__(
        self,
        connections: Connections,
        *,
        stages: Stages,
        store: JobStore,
        recorder: Recorder,
        deduper: Deduplicator,
        registered: Callable[[str], RegisteredStage] | None = None,
    ) -> None:
        self.connections = connections
        self.stages = stages
        self.store = store
        self.recorder = recorder
        self.deduper = deduper
        self.registered = registered

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
        """Up to ``limit`` entries, newest first, with ids below ``before`` (keyset paging:
        entries added meanwhile have higher ids, so pages never repeat nor skip one)."""
        where = _filters(stage=stage, queue=queue, since=since, include_retried=include_retried, until=until)
        q = select(dead_letters).where(where)
        if before is not None:
            q = q.where(dead_letters.c.id < before)
        with reading(self.connections.engine) as conn:
            return list(conn.execute(q.order_by(dead_letters.c.id.desc()).limit(limit)).mappings())

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
        """Open entries, newest first, filtered by stage/queue/time; each carries the job label."""
        where = _filters(stage=stage, queue=queue, since=since, include_retried=include_retried)
        with reading(self.connections.engine) as conn:
            total = conn.execute(select(func.count()).select_from(dead_letters).where(where)).scalar_one()
            items = list(
                conn.execute(
                    select(dead_letters)
                    .where(where)
                    .order_by(dead_letters.c.id.desc())
                    .limit(per_page)
                    .offset(max(0, page - 1) * per_page)
                ).mappings()
            )
        return DeadLetterPage(items, int(total), page, per_page)

    def show(self, entry_id: int) -> RowMapping | None:
        """One entry, with its traceback and headers."""
        with reading(self.connections.engine) as conn:
            return (
                conn.execute(select(dead_letters).where(dead_letters.c.id == entry_id))
                .mappings()
                .one_or_none()
            )

    def retry(self, entry_id: int, *, by: str = "cli") -> str | None:
        """Send the entry's job back to ``queued`` with a fresh attempt budget.

        A job with a dedup id takes it again as a ``submit()`` of it would, with the dedup
        mode and ``reuse`` it was submitted with (:meth:`_retake`); where that submit would
        be deduplicated into another job, the retry is refused (:class:`RetryRefused`,
        naming that job) and the entry stays open.

        The job runs again from its own stage: its stage's ``on_retry`` hook undoes what
        ``on_dead`` recorded, and when it completes, the continuation that ran with the
        dead job's result runs again with the new one. ``max_attempts`` grows to
        ``counted attempts + policy``; ``attempts`` never decreases, so fencing tokens stay
        monotonic. A job submitted with an expiry gets its window again, counted from the
        retry. Returns the job id, or None if nothing to retry.
        """
        with self.connections.engine.begin() as conn:
            entry = (
                conn.execute(
                    select(dead_letters).where(
                        dead_letters.c.id == entry_id, dead_letters.c.retried_at.is_(None)
                    )
                )
                .mappings()
                .one_or_none()
            )
            if entry is None or entry["job_id"] is None:
                return None
            job = self.store.get(conn, entry["job_id"])
            if job is None or job["status"] != s.DEAD:
                return None
            plan = self._rerun(job["stage"], entry_id)
            budget = plan.max_attempts
            if job["dedup_key"]:
                self._retake(conn, job, plan, entry_id)
            window: dict[str, Any] = {}
            if job["expires_at"] is not None and job["created_at"] is not None:
                # The job's expiry window again, from the retry: else a retry past it expires at once.
                seconds = max(0.0, (job["expires_at"] - job["created_at"]).total_seconds())
                window["expires_at"] = db_now_plus(seconds)
            res = conn.execute(
                update(jobs)
                .where(jobs.c.id == job["id"], jobs.c.status == s.DEAD, jobs.c.attempts == job["attempts"])
                .values(
                    status=s.QUEUED,
                    max_attempts=job["attempts"] - job["uncounted"] + budget,
                    published_at=None,
                    run_at=db_now(),
                    finished_at=None,
                    lease_owner=None,
                    updated_at=db_now(),
                    **window,
                )
            )
            if res.rowcount != 1:
                return None
            if plan.on_retry is not None:
                plan.on_retry(conn, job["payload"])
            conn.execute(
                update(dead_letters)
                .where(dead_letters.c.id == entry_id)
                .values(retried_at=db_now(), retried_by=by)
            )
            self.store.emit(
                conn, [new_event(job["id"], "job.dlq_retried", {"stage": job["stage"], "by": by})]
            )
        if job["dedup_key"]:
            with contextlib.suppress(Exception):  # a cached holder expires; Postgres is right
                self.deduper.forget(job["dedup_key"])
        self.recorder.republish_if_queued(job["id"])
        return str(job["id"])

    def settle(self, conn: Any, job_id: str, *, by: str, outcome: str) -> int:
        """Close the open entries of job ``job_id`` without running it again, in the
        caller's transaction: someone settled its outcome by hand (``outcome``, e.g.
        "delivered"). The job stays ``dead``; ``retried_by`` records who settled it and how.
        Returns how many entries were closed."""
        res = conn.execute(
            update(dead_letters)
            .where(dead_letters.c.job_id == job_id, dead_letters.c.retried_at.is_(None))
            .values(retried_at=db_now(), retried_by=f"settled by {by}: {outcome}"[:200])
        )
        if res.rowcount:
            body = {"by": by, "outcome": outcome}
            self.store.emit(conn, [new_event(job_id, "job.dlq_settled", body)])
        return int(res.rowcount or 0)

    def _retake(self, conn: Any, job: RowMapping, plan: _Rerun, entry_id: int) -> None:
        """Take the job's dedup id back, in the retry's transaction, by the decision a
        ``submit()`` of it would take now (:meth:`Deduplicator.acquire`, under the holder's
        mode and the ``reuse`` the job was submitted with); raise :class:`RetryRefused`
        naming the job that submit would be deduplicated into."""
        dedup_id = str(job["dedup_key"])
        scope, _, key = dedup_id.partition(":")
        stored = (job["options"] or {}).get(PLAN_OPTION) or {}
        reuse: Reuse = stored.get("reuse", "never")
        if stored.get("mode"):  # the plan it was submitted with (a per-submit Dedup too)
            mode, ttl = stored["mode"], stored.get("ttl")
        elif plan.dedup is not None:  # a job recorded before plans were kept: its stage's
            retention = self.connections.settings.retention_days * 86400
            mode, ttl = plan.dedup.mode, DedupPlan(plan.dedup, scope, key, reuse, retention).ttl
        else:
            mode, ttl = "simple", None
        now = self.deduper.clock()
        job_id = str(job["id"])
        acquired = self.deduper.acquire(
            conn, scope=scope, key=key, mode=mode, job_id=job_id, now=now, ttl=ttl, reuse=reuse
        )
        if acquired.won or acquired.holder == job_id:
            return
        holder = acquired.holder
        status = conn.execute(select(jobs.c.status).where(jobs.c.id == holder)).scalar_one_or_none()
        if status is None:
            why = f"was purged; retry entry {entry_id} once the reconciler frees the id"
        elif status not in s.TERMINAL:
            why = f"has not finished ({status}); retry entry {entry_id} once it has, or cancel it"
        else:
            why = (
                f"ended {status}: a submit of this job now (reuse={reuse!r}) would return that job "
                f"instead of running again; purge entry {entry_id}, or submit anew with reuse='always'"
            )
        raise RetryRefused(f"not retried: job {holder} holds dedup id {dedup_id!r} and {why}", holder=holder)

    def _rerun(self, stage: str, entry_id: int) -> _Rerun:
        """The stage's budget, dedup mode and hook: from its code, or (a client) from its
        registry row, refusing a stage whose hook only the deployment can run."""
        if self.registered is None:
            spec = self._spec(stage)
            if spec is None:
                return _Rerun(self.connections.settings.default_max_attempts, None, None)
            return _Rerun(spec.max_attempts, spec.dedup, spec.on_retry)
        try:
            row = self.registered(stage)
        except (UnknownStage, ConfigurationError):
            row = None
        if row is None or row.on_retry is not False or row.dedup_by_code:
            if row is not None and row.on_retry:
                why = "has an on_retry hook"
            elif row is not None and row.dedup_by_code:
                why = "has a dedup key only its code computes"
            else:
                why = "may have an on_retry hook (the registry does not say)"
            raise RetryNeedsDeployment(
                f"not retried: stage {stage} {why}, which only the deployment's code handles; retry "
                f"entry {entry_id} with `conveyor dlq retry {entry_id}`",
                entry_id=entry_id,
            )
        return _Rerun(row.max_attempts, row.dedup_policy(), None)

    def _spec(self, stage: str) -> StageSpec | None:
        """The stage's spec, importing the deployment's stage modules if this process (a
        CLI, a web app) has not: its ``on_retry`` hook and attempt budget apply."""
        try:
            return self.stages.spec(stage)
        except ConfigurationError:  # a stage since removed: retry it with the defaults
            return None

    def request_retry(self, entry_id: int, *, by: str) -> bool:
        """Ask a worker to retry the entry (for a stage whose ``on_retry`` hook only the
        deployment's code runs): recorded now, performed by the next reconciling pass of a
        worker's relay (:meth:`run_requested`). False when the entry is not open."""
        with self.connections.engine.begin() as conn:
            res = conn.execute(
                update(dead_letters)
                .where(
                    dead_letters.c.id == entry_id,
                    dead_letters.c.retried_at.is_(None),
                    dead_letters.c.job_id.is_not(None),
                )
                .values(retry_requested_at=db_now(), retry_requested_by=by[:200], retry_refused=None)
            )
        return res.rowcount == 1

    def run_requested(self, limit: int = 50) -> int:
        """Perform the retries clients asked for (a worker's relay calls this: it has the
        stages' hooks), oldest request first. Each entry ends retried, or keeps its request
        cleared with ``retry_refused`` saying why (a refusal or a failing hook is not
        retried forever); a database error leaves the request for the next pass. Returns
        how many were retried."""
        with reading(self.connections.engine) as conn:
            requested = conn.execute(
                select(dead_letters.c.id, dead_letters.c.retry_requested_by)
                .where(dead_letters.c.retry_requested_at.is_not(None), dead_letters.c.retried_at.is_(None))
                .order_by(dead_letters.c.retry_requested_at)
                .limit(limit)
            ).all()
        retried = 0
        for entry_id, by in requested:
            why: str | None = None
            try:
                if self.retry(int(entry_id), by=by or "api") is None:
                    why = "not retried: its job is no longer dead (retried or finished meanwhile)"
            except RetryRefused as exc:
                why = str(exc)
            except DBAPIError:
                raise
            except Exception as exc:  # the stage's own on_retry hook failed
                log.exception("the requested retry of dead letter %s failed", entry_id)
                why = f"not retried: the stage's on_retry hook raised {type(exc).__name__}: {exc}"[:2000]
            with self.connections.engine.begin() as conn:
                conn.execute(
                    update(dead_letters)
                    .where(dead_letters.c.id == entry_id)
                    .values(retry_requested_at=None, retry_refused=why)
                )
            retried += why is None
        return retried

    def retry_all(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        by: str = "cli",
        refused: builtins.list[RetryRefused] | None = None,
    ) -> builtins.list[str]:
        """Retry every open entry matching the filters, paging through all of them (entries
        without a job, and refused ones, are passed over, not stopped at). Returns the
        retried job ids; refusals are appended to ``refused`` when given."""
        retried: builtins.list[str] = []
        where = _filters(stage=stage, queue=queue, since=since, include_retried=False, until=until)
        last: int | None = None
        while True:
            q = select(dead_letters.c.id).where(where, dead_letters.c.job_id.is_not(None))
            if last is not None:
                q = q.where(dead_letters.c.id < last)
            with reading(self.connections.engine) as conn:
                page = conn.execute(q.order_by(dead_letters.c.id.desc()).limit(200)).scalars()
                ids = [int(i) for i in page]
            if not ids:
                return retried
            last = ids[-1]
            for entry_id in ids:
                try:
                    job_id = self.retry(entry_id, by=by)
                except RetryRefused as exc:
                    if refused is not None:
                        refused.append(exc)
                    continue
                if job_id:
                    retried.append(job_id)

    def purge(self, *, older_than_days: float | None = None) -> int:
        """Delete entries past retention (default: the DLQ retention setting)."""
        settings = self.connections.settings
        days = settings.dlq_retention_days if older_than_days is None else older_than_days
        with self.connections.engine.begin() as conn:
            res = conn.execute(
                delete(dead_letters).where(dead_letters.c.created_at < db_now_plus(-days * 86400))
            )
        return int(res.rowcount or 0)

    def purge_matching(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        include_retried: bool = True,
    ) -> int:
        """Delete the entries matching the filters (no filter: every entry); their jobs
        stay ``dead``. Returns how many were deleted."""
        where = _filters(stage=stage, queue=queue, since=since, include_retried=include_retried, until=until)
        with self.connections.engine.begin() as conn:
            res = conn.execute(delete(dead_letters).where(where))
        return int(res.rowcount or 0)


def _filters(
    *,
    stage: str | None,
    queue: str | None,
    since: dt.datetime | None,
    include_retried: bool,
    until: dt.datetime | None = None,
) -> Any:
    cond: list[Any] = []
    if not include_retried:
        cond.append(dead_letters.c.retried_at.is_(None))
    if stage:
        cond.append(dead_letters.c.stage == stage)
    if queue:
        cond.append(dead_letters.c.queue == queue)
    if since is not None:
        cond.append(dead_letters.c.created_at >= since)
    if until is not None:
        cond.append(dead_letters.c.created_at < until)
    return and_(True, *cond)


__all__ = ["DeadLetterPage", "DeadLetterQueue"]
