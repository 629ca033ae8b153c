"""What a stage body sees: its job, attempt, progress, events and transaction."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, update
from sqlalchemy.orm import Session

from conveyor.db.schema import jobs
from conveyor.store import new_event

if TYPE_CHECKING:
    from conveyor.platform import Platform

log = logging.getLogger("conveyor.job")


class JobLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger that stamps every line with the job id, stage and attempt."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        return f"[{extra.get('stage')} {extra.get('job_id')} #{extra.get('attempt')}] {msg}", kwargs


class JobContext:
    """Per-attempt context handed to a stage body.

    ``session``/``connection`` open one transaction lazily; the platform commits it together
    with the job's completion compare-and-set and the events from :meth:`emit`, so a
    stage's effect and its ``succeeded`` status commit or roll back as one.
    """

    def __init__(
        self, platform: Platform, *, job_id: str, attempt: int, stage: str, flow_id: str | None
    ) -> None:
        self.platform = platform
        self.job_id = job_id
        self.attempt = attempt
        self.stage = stage
        self.flow_id = flow_id
        self.log = JobLogger(log, {"job_id": job_id, "stage": stage, "attempt": attempt})
        self.events: list[dict[str, Any]] = []
        self._conn: Connection | None = None
        self._session: Session | None = None
        self.lease_lost = False

    @property
    def connection(self) -> Connection:
        """The attempt's connection, in a transaction committed with the completion."""
        if self._conn is None:
            self._conn = self.platform.engine.connect()
            self._conn.begin()
        return self._conn

    @property
    def session(self) -> Session:
        """An ORM session on :attr:`connection` (same transaction)."""
        if self._session is None:
            self._session = Session(bind=self.connection, join_transaction_mode="create_savepoint")
        return self._session

    def emit(self, topic: str, body: Mapping[str, Any]) -> None:
        """Queue an outbox event; it commits with the job's completion, or not at all."""
        self.events.append(new_event(self.job_id, topic, body))

    def progress(self, value: float | None = None, **data: Any) -> None:
        """Record progress now (its own small transaction), visible while the job runs."""
        info = {**data, **({"value": value} if value is not None else {})}
        store = self.platform.store
        with self.platform.engine.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == self.job_id).values(progress=info))
            store.emit(conn, [new_event(self.job_id, "job.progress", info)])

    def checkpoint(self) -> None:
        """A safe point to stop: raises if this attempt was fenced off."""
        if self.lease_lost:
            from conveyor.errors import LeaseLost

            raise LeaseLost(f"job {self.job_id} attempt {self.attempt} lost its lease")

    # -- used by the runner -------------------------------------------------------------

    def take_connection(self) -> Connection | None:
        """Hand the open transaction (if any) to the runner for the completion commit."""
        if self._session is not None:
            self._session.flush()
        return self._conn

    def close(self) -> None:
        """Roll back anything uncommitted and return the connection."""
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._conn is not None:
            try:
                if self._conn.in_transaction():
                    self._conn.rollback()
            finally:
                self._conn.close()
                self._conn = None
