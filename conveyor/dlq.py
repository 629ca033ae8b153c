"""The dead-letter queue: list, show, retry one, retry all, purge."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, delete, func, select, update
from sqlalchemy.engine import RowMapping

from conveyor.db import schema as s
from conveyor.db.dialect import db_now, db_now_plus
from conveyor.db.schema import dead_letters, jobs
from conveyor.store import new_event

if TYPE_CHECKING:
    from conveyor.platform import Platform


@dataclass
class DeadLetterPage:
    """One page of open dead letters."""

    items: list[RowMapping]
    total: int
    page: int
    per_page: int


class DeadLetterQueue:
    """Operations on ``dead_letters``; retries go back through the relay."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def list(
        self,
        *,
        stage: str | None = None,
        queue: str | None = None,
        page: int = 1,
        per_page: int = 50,
        include_retried: bool = False,
    ) -> DeadLetterPage:
        """Open entries, newest first, filtered by stage/queue; each carries the job label."""
        cond: list[Any] = []
        if not include_retried:
            cond.append(dead_letters.c.retried_at.is_(None))
        if stage:
            cond.append(dead_letters.c.stage == stage)
        if queue:
            cond.append(dead_letters.c.queue == queue)
        where = and_(True, *cond)
        with self.platform.engine.connect() as conn:
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
        with self.platform.engine.connect() as conn:
            return (
                conn.execute(select(dead_letters).where(dead_letters.c.id == entry_id))
                .mappings()
                .one_or_none()
            )

    def retry(self, entry_id: int, *, by: str = "cli") -> str | None:
        """Send the entry's job back to ``queued`` with a fresh attempt budget.

        The job runs again from its own stage: its stage's ``on_retry`` hook undoes what
        ``on_dead`` recorded, and when it completes, the continuation that ran with the
        dead job's result runs again with the new one. ``max_attempts`` grows to
        ``counted attempts + policy``; ``attempts`` never decreases, so fencing tokens stay
        monotonic. Returns the job id, or None if nothing to retry.
        """
        with self.platform.engine.begin() as conn:
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
            job = self.platform.store.get(conn, entry["job_id"])
            if job is None or job["status"] != s.DEAD:
                return None
            spec = self.platform.stages.get(job["stage"])
            budget = spec.max_attempts if spec else self.platform.settings.default_max_attempts
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
                )
            )
            if res.rowcount != 1:
                return None
            if spec is not None and spec.on_retry is not None:
                spec.on_retry(conn, job["payload"])
            conn.execute(
                update(dead_letters)
                .where(dead_letters.c.id == entry_id)
                .values(retried_at=db_now(), retried_by=by)
            )
            self.platform.store.emit(
                conn, [new_event(job["id"], "job.dlq_retried", {"stage": job["stage"], "by": by})]
            )
        self.platform.republish_if_queued(job["id"])
        return str(job["id"])

    def retry_all(
        self, *, stage: str | None = None, queue: str | None = None, by: str = "cli"
    ) -> builtins.list[str]:
        """Retry every open entry matching the filters; returns the retried job ids."""
        retried: builtins.list[str] = []
        while True:
            page = self.list(stage=stage, queue=queue, per_page=200)
            ids = [int(e["id"]) for e in page.items if e["job_id"] is not None]
            batch = [j for j in (self.retry(i, by=by) for i in ids) if j]
            retried += batch
            if not batch:
                return retried

    def purge(self, *, older_than_days: float | None = None) -> int:
        """Delete entries past retention (default: the DLQ retention setting)."""
        days = self.platform.settings.dlq_retention_days if older_than_days is None else older_than_days
        with self.platform.engine.begin() as conn:
            res = conn.execute(
                delete(dead_letters).where(dead_letters.c.created_at < db_now_plus(-days * 86400))
            )
        return int(res.rowcount or 0)
