"""``/events``: the event outbox in commit order, as pages with a cursor and as a
Server-Sent Events stream that resumes from ``Last-Event-ID``.

A token sees only the events of its owner's jobs unless it is ``admin``; an event without
a job (or of a purged job) is an admin's only. ``owner=`` naming another owner is 403 for
a token that is not ``admin`` (rather than an empty feed that would look like silence).
Filters: ``job`` (its id), ``flow`` (a flow's root job id: a job alone is its own flow),
``batch`` (events whose body carries that ``batch_id``; see :mod:`conveyor.web.feed`).

Open streams end when :func:`streams_end` is set (``conveyor serve`` sets it on SIGTERM or
SIGINT, so that a graceful shutdown does not wait for clients that never hang up). A
stream reads the outbox again as soon as a commit announces new events (a Redis wake-up,
:mod:`conveyor.delivery.wakeups`, heard by one subscriber per process for all its
streams; at most one read per :data:`WAKE_GAP`), and every :data:`POLL_SECONDS` anyway,
so a lost wake-up (or Redis away) costs at most a poll: one read at a time per
connection, in a worker thread, at most :data:`STREAM_PAGE` events held, a database
connection only during a read.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, FastAPI, Header, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import Engine, RowMapping
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from conveyor.delivery.celeryconfig import PLACEHOLDER_BROKER
from conveyor.delivery.wakeups import Subscriber, events_channel, subscriber
from conveyor.settings import ConveyorSettings
from conveyor.web.auth import Caller, Reader, client_of
from conveyor.web.feed import CursorAhead, FeedFilter, FeedPage, read_page
from conveyor.web.limits import Held, held_limit
from conveyor.web.links import link
from conveyor.web.problems import Problem, responses

log = logging.getLogger("conveyor.web")

router = APIRouter(prefix="/events", tags=["events"])

AUTH = (401, 403)
POLL_SECONDS = 0.5  # how soon a stream sees a new event when no wake-up came
WAKE_GAP = 0.05  # a stream reads at most this often, however many wake-ups come (DB load)
HEARTBEAT_SECONDS = 15.0  # a comment when nothing was sent for this long (proxies close idle streams)
RETRY_MS = 2000  # how long a browser's EventSource waits before reconnecting
STREAM_PAGE = 500
SSE = "text/event-stream"
NEXT_EVENTS = link("listEvents", "the events after these", since="$response.body#/cursor")


class FeedEvent(BaseModel):
    """One event of the outbox."""

    id: int
    job_id: str | None = Field(description="the job it is about (none: an event of no job)")
    topic: str = Field(examples=["job.succeeded"])
    body: dict[str, Any]
    position: str = Field(description="its place in commit order: the cursor right after it")
    created_at: dt.datetime

    @classmethod
    def from_row(cls, row: RowMapping) -> FeedEvent:
        """The view of a ``job_events`` row read with its position."""
        return cls(
            id=row["id"],
            job_id=row["job_id"],
            topic=row["topic"],
            body=dict(row["body"]),
            position=str(row["position"]),
            created_at=row["created_at"],
        )


class EventPage(BaseModel):
    """Events in commit order, and the cursor to read the next ones from."""

    events: list[FeedEvent]
    cursor: str = Field(description="pass as since= to read on (it may move past events you do not see)")


Since = Annotated[
    str | None, Query(max_length=100, description="a cursor from an earlier page (none: from the start)")
]
JobFilter = Annotated[str | None, Query(max_length=64, description="only this job's events")]
FlowFilter = Annotated[
    str | None, Query(max_length=64, description="only the events of this flow's jobs (its root job id)")
]
BatchFilter = Annotated[
    str | None, Query(max_length=200, description="only events whose body has this batch_id")
]
OwnerFilter = Annotated[
    str | None, Query(max_length=64, description="only this owner's jobs' events (another owner's: admin)")
]


def _filter(
    caller: Caller, job: str | None, flow: str | None, batch: str | None, owner: str | None
) -> FeedFilter:
    if caller.token.admin:
        return FeedFilter(job=job, flow=flow, batch=batch, owner=owner)
    if owner is not None and owner != caller.owner:
        raise Problem(403, "forbidden", "Forbidden", "only an admin token reads another owner's events")
    return FeedFilter(job=job, flow=flow, batch=batch, owner=caller.owner)


def _invalid_cursor(name: str, exc: ValueError) -> Problem:
    if isinstance(exc, CursorAhead):
        detail = f"{name} is past the newest event (was the database replaced?): read again from the start"
        return Problem(422, "invalid-cursor", "Invalid cursor", detail)
    return Problem(422, "invalid-cursor", "Invalid cursor", f"{name} is not a cursor of this API")


@router.get(
    "",
    response_model=EventPage,
    operation_id="listEvents",
    summary="Events in commit order, a page at a time",
    description="Scope `read`. The events after `since` (every one exactly once, in commit order, "
    "when paging on with `cursor`); the events of the token's owner's jobs unless it is `admin`. "
    "`owner=` naming another owner is 403 for a token that is not `admin`.",
    responses={200: {"links": {"NextEvents": NEXT_EVENTS}}, **responses(*AUTH, 422, 503)},
)
def list_events(
    request: Request,
    caller: Reader,
    since: Since = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many events")] = 500,
    job: JobFilter = None,
    flow: FlowFilter = None,
    batch: BatchFilter = None,
    owner: OwnerFilter = None,
) -> EventPage:
    """A page of the events the caller sees after ``since``."""
    where = _filter(caller, job, flow, batch, owner)
    try:
        page = read_page(client_of(request).connections.engine, since, where, limit)
    except ValueError as exc:
        raise _invalid_cursor("since", exc) from None
    return EventPage(events=[FeedEvent.from_row(r) for r in page.rows], cursor=page.cursor)


@router.get(
    "/stream",
    response_class=StreamingResponse,
    operation_id="streamEvents",
    summary="Events as a Server-Sent Events stream",
    description="Scope `read`; the filters of `GET /events`. Each event is sent as `id: <cursor>`, "
    "`event: <topic>`, `data: <the event as JSON>`; a reconnecting client sends `Last-Event-ID` "
    "(wins over `since`) and receives every later event once, in order. A `: keep-alive` comment "
    "comes after 15 s without events. 503 `busy` when the server holds its most streams and "
    "waits (`CONVEYOR_HTTP_MAX_HELD`) open already.",
    responses={
        200: {
            "description": "the stream; it ends only when the server stops or the database does not answer "
            "(reconnect with Last-Event-ID)",
            "content": {SSE: {"schema": {"type": "string"}}},
        },
        **responses(*AUTH, 422, 503),
    },
)
async def stream_events(
    request: Request,
    caller: Reader,
    since: Since = None,
    job: JobFilter = None,
    flow: FlowFilter = None,
    batch: BatchFilter = None,
    owner: OwnerFilter = None,
    last_event_id: Annotated[
        str | None, Header(max_length=100, description="the id of the last event received")
    ] = None,
) -> StreamingResponse:
    """The events the caller sees after ``Last-Event-ID`` (or ``since``), then each new one."""
    where = _filter(caller, job, flow, batch, owner)
    return await open_stream(request, where, since, last_event_id)


async def open_stream(
    request: Request,
    where: FeedFilter,
    since: str | None,
    last_event_id: str | None,
    frame: Callable[[FeedEvent], str] | None = None,
) -> StreamingResponse:
    """The stream of the events matching ``where`` after ``last_event_id`` (or ``since``):
    each event as ``frame`` writes it (default: ``id``, ``event``: its topic, ``data``)."""
    connections = client_of(request).connections
    engine = connections.engine
    start = last_event_id if last_event_id is not None else since
    held = held_limit(request.app).hold("a stream")
    try:
        # The first read answers a bad cursor or a database outage as a problem, before streaming.
        first = await run_in_threadpool(read_page, engine, start, where, STREAM_PAGE)
    except ValueError as exc:
        held.release()
        raise _invalid_cursor("Last-Event-ID" if last_event_id is not None else "since", exc) from None
    except BaseException:
        held.release()
        raise
    return StreamingResponse(
        _stream(engine, where, first, streams_end(request.app), held, frame, _wakes(connections.settings)),
        media_type=SSE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        # Also when the client went away and the stream was cancelled before its finally ran.
        background=BackgroundTask(held.release),
    )


def streams_end(app: FastAPI) -> threading.Event:
    """The app's signal to end its open event streams (clients then reconnect elsewhere, or
    later, with ``Last-Event-ID``): set it when the server begins to shut down."""
    end: threading.Event = app.state.conveyor_streams_end
    return end


def _wakes(settings: ConveyorSettings) -> Subscriber | None:
    """This process's subscriber to the outbox's wake-ups (None: no Redis configured)."""
    url = settings.redis_url
    if not url or url == PLACEHOLDER_BROKER:
        return None
    return subscriber(url, events_channel(settings.key_prefix))


class _Wake:
    """One stream's wake-up flag: set from the subscriber's thread, awaited on the stream's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = anyio.Event()

    def set_soon(self) -> None:
        """Set the flag (from any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the stream is gone
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        """Until the flag is set (then clear it) or ``timeout`` seconds have passed."""
        with anyio.move_on_after(timeout):
            await self._event.wait()
        if self._event.is_set():
            self._event = anyio.Event()


async def _stream(
    engine: Engine,
    where: FeedFilter,
    page: FeedPage,
    end: threading.Event,
    held: Held,
    frame: Callable[[FeedEvent], str] | None = None,
    wakes: Subscriber | None = None,
) -> AsyncIterator[str]:
    """The stream's frames until ``end`` is set. Starlette cancels it when the client disconnects.

    Between reads it waits for a wake-up from ``wakes`` or :data:`POLL_SECONDS`, whichever
    comes first (only the poll on an event loop that is not asyncio's)."""
    frame = frame or _frame
    wake: _Wake | None = None
    unsubscribe: Callable[[], None] | None = None
    try:
        if wakes is not None:
            with contextlib.suppress(RuntimeError):  # not on asyncio (trio): the poll alone
                wake = _Wake(asyncio.get_running_loop())
                unsubscribe = wakes.add(wake.set_soon)
        yield f"retry: {RETRY_MS}\n\n"
        sent = page_read = time.monotonic()
        while not end.is_set():
            if page.rows:
                yield "".join(frame(FeedEvent.from_row(r)) for r in page.rows)
                sent = time.monotonic()
            elif time.monotonic() - sent >= HEARTBEAT_SECONDS:
                yield ": keep-alive\n\n"
                sent = time.monotonic()
            if not page.full:
                if wake is None:
                    await anyio.sleep(POLL_SECONDS)
                else:
                    await wake.wait(POLL_SECONDS)
                    # A wake-up per commit must not become a read per commit: reads are spaced.
                    await anyio.sleep(max(0.0, WAKE_GAP - (time.monotonic() - page_read)))
            page_read = time.monotonic()
            try:
                page = await run_in_threadpool(read_page, engine, page.cursor, where, STREAM_PAGE)
            except (DBAPIError, PoolTimeout) as exc:
                # The client reconnects with its Last-Event-ID and loses nothing.
                log.warning("event stream ended: the database did not answer (%s)", type(exc).__name__)
                return
    finally:
        if unsubscribe is not None:
            unsubscribe()
        held.release()


def _frame(event: FeedEvent) -> str:
    topic = " ".join(event.topic.splitlines())  # a field is one line
    return f"id: {event.position}\nevent: {topic}\ndata: {event.model_dump_json()}\n\n"


__all__ = ["EventPage", "FeedEvent", "open_stream", "router", "streams_end"]
