"""What a stage body sees: its job, attempt, progress, events and transaction."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection, select, update
from sqlalchemy.orm import Session
from structlog.stdlib import BoundLogger

from conveyor.client.stops import CANCEL, PREEMPT, Stops
from conveyor.delivery.connections import Connections
from conveyor.errors import Cancelled, LeaseLost, Preempted
from conveyor.logs import JobTokens, bind_job, job_logger, unbind_job
from conveyor.store.db.schema import RUNNING, jobs, leases
from conveyor.store.jobs import JobStore, NewJob, new_event
from conveyor.worker.admission import Slot
from conveyor.worker.continuations import Continuations
from conveyor.worker.leases import Held


@dataclass(frozen=True)
class ContextServices:
    """What a job context works through: the connections, the store and the stop flags."""

    connections: Connections
    store: JobStore
    stops: Stops
    continuations: Continuations | None = None  # what ctx.submit() builds its jobs with


class JobContext:
    """Per-attempt context handed to a stage body.

    ``session``/``connection`` open one transaction lazily; the runner commits it together
    with the job's completion compare-and-set and the events from :meth:`emit`, so a
    stage's effect and its ``succeeded`` status commit or roll back as one.

    From creation to :meth:`close`, every log line of the attempt's thread (its own
    ``log``, Conveyor's, Celery's, a library's) carries ``job_id``, ``stage``, ``attempt``
    and ``queue`` (see ``conveyor.logs``).
    """

    def __init__(
        self,
        services: ContextServices,
        *,
        job_id: str,
        attempt: int,
        stage: str,
        flow_id: str | None,
        queue: str | None = None,
        owner: str | None = None,
        final_attempt: bool = False,
    ) -> None:
        self.services = services
        self.job_id = job_id
        self.attempt = attempt
        self.stage = stage
        self.flow_id = flow_id
        self.queue = queue
        # Whose job this is (an API token's owner, ``owner=`` at submit; None: the
        # deployment's): a body acting on a tenant's data checks it is theirs.
        self.owner = owner
        # This attempt is the job's last counted one: a failure now dead-letters it, so a
        # body with a useful partial answer may give it instead of failing.
        self.final_attempt = final_attempt
        self._log: BoundLogger | None = None
        self._log_tokens: JobTokens | None = bind_job(job_id, stage, attempt, queue)
        self.events: list[dict[str, Any]] = []
        self.children: list[NewJob] = []  # ctx.submit(): inserted with the completion
        self._conn: Connection | None = None
        self._session: Session | None = None
        self.lease_lost = False
        self.held: Held | None = None
        self.slot: Slot | None = None  # a concurrency slot, renewed with the heartbeat
        self.stop_requested: str | None = None  # "preempt" / "cancel", set by the poller
        # The stop this attempt is handling once Preempted/Cancelled was raised into it:
        # later interrupts for it are dropped, so its cleanup runs to its end.
        self.stopping: str | None = None
        self._last_check = 0.0

    @property
    def log(self) -> BoundLogger:
        """The attempt's logger (:func:`conveyor.logs.job_logger`), made on first use."""
        if self._log is None:
            self._log = job_logger(
                job_id=self.job_id, stage=self.stage, attempt=self.attempt, queue=self.queue
            )
        return self._log

    @property
    def connection(self) -> Connection:
        """The attempt's connection, in a transaction committed with the completion."""
        if self._conn is None:
            self._conn = self.services.connections.engine.connect()
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

    def submit(self, stage: str, payload: Mapping[str, Any] | BaseModel | None = None, **options: Any) -> str:
        """Submit a job when this one completes: recorded in the completion's transaction
        (the same dedup decision as a submit, this job's owner), published after it commits,
        as a chain link is; nothing if this attempt fails. Options as ``submit()``'s
        (``delay``, ``run_at``, ``priority``, ``label``, ``max_attempts``, ``dedup``,
        ``reuse``, ``idempotency_key``, ``job_id``, ``expires_in``). Returns the id the job
        gets if recorded (a duplicate by dedup is not: the holder stands for it)."""
        continuations = self.services.continuations
        if continuations is None:
            raise RuntimeError("ctx.submit() is for a stage body run by a worker")
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload or {})
        new = continuations.child(stage, data, options)
        self.children.append(new)
        return new.id

    def progress(self, value: float | None = None, **data: Any) -> None:
        """Record progress now (its own small transaction), visible while the job runs."""
        info = {**data, **({"value": value} if value is not None else {})}
        store = self.services.store
        with self.services.connections.engine.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == self.job_id).values(progress=info))
            store.emit(conn, [new_event(self.job_id, "job.progress", info)])

    def checkpoint(self, *, fresh: bool = True) -> None:
        """A safe point to stop. Call it in loops (e.g. every 10 records).

        Raises :class:`Preempted` when a higher-priority job needs this job's lease (the
        job is requeued and runs again later), :class:`Cancelled` after ``cancel()``, and
        :class:`LeaseLost` when this attempt no longer owns the job. With ``fresh=False``
        only the flag the heartbeat thread polls is read (no Redis round trip).
        """
        if self.lease_lost:
            raise LeaseLost(f"job {self.job_id} attempt {self.attempt} lost its lease")
        kind = self.stop_requested
        now = time.monotonic()
        if fresh and kind is None and now - self._last_check >= 0.02:
            self._last_check = now
            kind = self.stop_requested = self.services.stops.stop_requested(self.job_id, self.attempt)
        if kind == PREEMPT:
            self.stopping = kind
            raise Preempted(f"job {self.job_id} yields its lease to a higher-priority job")
        if kind == CANCEL:
            self.stopping = kind
            raise Cancelled(f"job {self.job_id} was cancelled")

    @contextmanager
    def fenced(self) -> Iterator[Connection]:
        """A transaction that commits only while this attempt owns the job and its lease.

        The job row (and the lease row) are locked for the transaction, so a takeover
        cannot slip in between the check and the commit; it fails closed.
        """
        with self.services.connections.engine.begin() as conn:
            owned = conn.execute(
                select(jobs.c.id)
                .where(jobs.c.id == self.job_id, jobs.c.status == RUNNING, jobs.c.attempts == self.attempt)
                .with_for_update()
            ).first()
            if owned is None:
                raise LeaseLost(f"job {self.job_id} attempt {self.attempt} no longer owns the job")
            if self.held is not None:
                holds = conn.execute(
                    select(leases.c.key)
                    .where(
                        leases.c.key == self.held.key,
                        leases.c.holder_job == self.job_id,
                        leases.c.token == self.held.token,
                    )
                    .with_for_update()
                ).first()
                if holds is None:
                    raise LeaseLost(f"job {self.job_id} no longer holds lease {self.held.key}")
            yield conn

    def rollback(self) -> None:
        """Drop what the body wrote on :attr:`connection` so far and end its transaction
        (on SQLite it holds the one writer); the outcome is then recorded on its own."""
        if self._session is not None:
            self._session.close()
            self._session = None
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if conn.in_transaction():
                    conn.rollback()
            finally:
                conn.close()

    # -- used by the runner -------------------------------------------------------------

    def take_connection(self) -> Connection | None:
        """Hand the open transaction (if any) to the runner for the completion commit."""
        if self._session is not None:
            self._session.flush()
        return self._conn

    def close(self) -> None:
        """Roll back anything uncommitted, return the connection and unbind the job's log
        fields. Safe to call more than once."""
        tokens, self._log_tokens = self._log_tokens, None
        if tokens is not None:  # first, so a failing rollback cannot leave them bound
            unbind_job(tokens)
        self.rollback()


__all__ = ["ContextServices", "JobContext"]
