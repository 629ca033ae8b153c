"""A handle on one job: status, wait, result, events, cancel."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from conveyor.delivery.connections import Connections
from conveyor.store.db import schema as s
from conveyor.store.db.engine import reading
from conveyor.store.jobs import JobStore, Row
from conveyor.wire import from_wire

POLL_WITHOUT_REDIS = 0.5  # wait() reads Postgres this often while Redis does not answer


@dataclass
class JobEvent:
    """One outbox event."""

    id: int
    job_id: str | None
    topic: str
    body: dict[str, Any]
    position: str


class JobHandle:
    """What :meth:`Platform.submit` returns. ``deduplicated`` is True when an existing job
    (same idempotency key or canvas task id) was returned instead of a new one.

    ``cancel`` is the platform's (:meth:`conveyor.client.stops.Stops.cancel`).
    """

    def __init__(
        self,
        job_id: str,
        *,
        connections: Connections,
        store: JobStore,
        cancel: Callable[..., str],
        deduplicated: bool = False,
        task_id: str | None = None,
    ) -> None:
        self.connections = connections
        self.store = store
        self._cancel = cancel
        self.id = job_id
        self.deduplicated = deduplicated
        self.task_id = task_id
        self.dedup_seq: int | None = None  # debounce: this submit's sequence number
        self.dedup_at: float | None = None  # the dedup clock reading this submit used

    def __repr__(self) -> str:
        return f"<JobHandle {self.id}{' (deduplicated)' if self.deduplicated else ''}>"

    def row(self) -> Row:
        """The job's current row."""
        with reading(self.connections.engine) as conn:
            row = self.store.get(conn, self.id)
        if row is None:
            raise LookupError(f"job {self.id} not found")
        return row

    def status(self) -> str:
        """The job's current status."""
        return str(self.row()["status"])

    def _status_or_none(self) -> str | None:
        with reading(self.connections.engine) as conn:
            row = self.store.get(conn, self.id)
        return None if row is None else str(row["status"])

    @property
    def result(self) -> Any:
        """The stored result of a succeeded job (None otherwise), bytes, datetimes, Decimal
        and UUID as the body returned them."""
        return from_wire(self.row()["result"])

    def wait(self, timeout: float = 30.0) -> str:
        """Block until the job is terminal; returns the status. Raises ``TimeoutError``.

        A job that does not exist yet (a chain link whose predecessor is still running) is
        waited for like any other.

        Subscribes to the job's wake channel *before* reading the status, so a completion
        between the two cannot be missed; no sleep-polling.
        """
        deadline = time.monotonic() + timeout
        pubsub: Any = None
        try:
            while True:
                if pubsub is None and not self.connections.fast.down:
                    try:
                        # The short-timeout client: a frozen Redis fails the subscribe at
                        # once instead of holding the caller (``get_message`` has its own).
                        client = self.connections.fast.client()
                        pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                        pubsub.subscribe(self.connections.broker.wake_channel(self.id))
                    except RedisError as exc:  # Redis away: Postgres alone answers, polled
                        self.connections.fast.trip(type(exc).__name__)
                        _close(pubsub)
                        pubsub = None
                # A chain link's row appears when the link before it completes.
                status = self._status_or_none()
                if status in s.TERMINAL:
                    return status
                left = deadline - time.monotonic()
                if left <= 0:
                    if status is None:
                        raise TimeoutError(
                            f"job {self.id} not found after {timeout}s: not committed (yet), in "
                            "another database, or a chain link not reached"
                        )
                    raise TimeoutError(f"job {self.id} still {status} after {timeout}s")
                if pubsub is None:
                    time.sleep(min(left, POLL_WITHOUT_REDIS))
                    continue
                try:
                    # A bounded wait also covers a notification lost with a Redis restart.
                    pubsub.get_message(timeout=min(left, 5.0))
                except RedisError as exc:
                    self.connections.fast.trip(type(exc).__name__)
                    _close(pubsub)
                    pubsub = None
        finally:
            _close(pubsub)

    def cancel(self, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel this job (see :meth:`Platform.cancel`); returns the resulting status."""
        return self._cancel(self.id, by=by, reason=reason)

    def events(self, since: str | None = None) -> tuple[list[JobEvent], str | None]:
        """This job's events after cursor ``since``, and the next cursor."""
        with reading(self.connections.engine) as conn:
            rows, cursor = self.store.events_since(conn, since, job_id=self.id)
        return [
            JobEvent(r["id"], r["job_id"], r["topic"], dict(r["body"]), str(r["position"])) for r in rows
        ], cursor


__all__ = ["JobEvent", "JobHandle"]


def _close(pubsub: Any) -> None:
    """Close a subscription that may already be broken."""
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()
