"""The client for asyncio apps (ASGI: FastAPI, Starlette, Django's async views).

Each call runs the synchronous :class:`conveyor.client.by_name.Client` in a worker thread
(``asyncio.to_thread``), so the event loop never waits on Postgres or Redis: a submit is a
round trip or two, and ``wait`` blocks only its own thread. To join your own transaction,
submit inside ``await session.run_sync(lambda s: client.sync.submit(..., session=s))``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Mapping
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy.engine import RowMapping

from conveyor import connect
from conveyor.client.by_name import DeadLetters
from conveyor.client.dlq import DeadLetterPage
from conveyor.client.handle import JobEvent, JobHandle
from conveyor.client.registry import RegisteredStage
from conveyor.dedup import Reuse
from conveyor.settings import ConveyorSettings
from conveyor.store.jobs import Row


class AsyncJobHandle:
    """A :class:`conveyor.client.handle.JobHandle` whose reads are awaited."""

    def __init__(self, handle: JobHandle) -> None:
        self.sync = handle
        self.id = handle.id
        self.deduplicated = handle.deduplicated

    def __repr__(self) -> str:
        return f"<AsyncJobHandle {self.id}{' (deduplicated)' if self.deduplicated else ''}>"

    async def row(self) -> Row:
        """The job's row."""
        return await asyncio.to_thread(self.sync.row)

    async def status(self) -> str:
        """The job's status now."""
        return await asyncio.to_thread(self.sync.status)

    @property
    def result(self) -> Awaitable[Any]:
        """The job's stored result (None unless it succeeded): ``await job.result``."""
        return asyncio.to_thread(lambda: self.sync.result)

    async def wait(self, timeout: float = 30.0) -> str:
        """Wait until the job is terminal (or ``timeout``); returns its status."""
        return await asyncio.to_thread(self.sync.wait, timeout)

    async def cancel(self, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel the job; returns the status it ends up in."""
        return await asyncio.to_thread(self.sync.cancel, by=by, reason=reason)

    async def events(self, since: str | None = None) -> tuple[list[JobEvent], str | None]:
        """The job's events after cursor ``since``, and the next cursor."""
        return await asyncio.to_thread(self.sync.events, since)


class AsyncDeadLetters:
    """:class:`conveyor.client.by_name.DeadLetters`, awaited."""

    def __init__(self, dead_letters: DeadLetters) -> None:
        self.sync = dead_letters

    async def list(self, **filters: Any) -> DeadLetterPage:
        """Open entries, newest first (the filters of :meth:`DeadLetters.list`)."""
        return await asyncio.to_thread(lambda: self.sync.list(**filters))

    async def show(self, entry_id: int) -> RowMapping | None:
        """One entry, with its traceback and headers."""
        return await asyncio.to_thread(self.sync.show, entry_id)


class AsyncClient:
    """:class:`conveyor.client.by_name.Client` for asyncio code; the same options and errors."""

    def __init__(
        self,
        settings: ConveyorSettings | None = None,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        broker_url: str | None = None,
    ) -> None:
        # conveyor.connect(): without settings, a Django project's own, as for the sync client
        self.sync = connect(settings, database_url=database_url, redis_url=redis_url, broker_url=broker_url)

    @property
    def dlq(self) -> AsyncDeadLetters:
        """The dead-letter queue, read-only."""
        return AsyncDeadLetters(self.sync.dlq)

    async def stages(self, *, refresh: bool = False) -> dict[str, RegisteredStage]:
        """The registered stages by name."""
        return await asyncio.to_thread(self.sync.stages, refresh=refresh)

    async def submit(
        self,
        stage: str,
        payload: BaseModel | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        run_at: dt.datetime | None = None,
        expires_in: float | None = None,
        priority: int | None = None,
        label: str | None = None,
        max_attempts: int | None = None,
        dedup: Literal[False] | None = None,
        reuse: Reuse = "never",
        owner: str | None = None,
    ) -> AsyncJobHandle:
        """Record a job of stage ``stage`` and publish it after commit."""
        handle = await asyncio.to_thread(
            self.sync.submit,
            stage,
            payload,
            idempotency_key=idempotency_key,
            delay=delay,
            run_at=run_at,
            expires_in=expires_in,
            priority=priority,
            label=label,
            max_attempts=max_attempts,
            dedup=dedup,
            reuse=reuse,
            owner=owner,
        )
        return AsyncJobHandle(handle)

    def job(self, job_id: str) -> AsyncJobHandle:
        """A handle on an existing job."""
        return AsyncJobHandle(self.sync.job(job_id))

    async def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in."""
        return await asyncio.to_thread(self.sync.cancel, job_id, by=by, reason=reason)

    async def close(self) -> None:
        """Close the connections."""
        await asyncio.to_thread(self.sync.close)


__all__ = ["AsyncClient", "AsyncDeadLetters", "AsyncJobHandle"]
