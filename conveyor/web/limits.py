"""Bounds of the HTTP API: on request bodies (a submit carries a payload of at most
``CONVEYOR_MAX_PAYLOAD_BYTES``, so a body much larger than that is refused, 413, before
anything parses it, whether it declares its length or comes in chunks), and on requests
held open (event streams, waits for a job), so that they never take every thread or
connection a server process has (503 past ``CONVEYOR_HTTP_MAX_HELD``).

An endpoint that takes a body of its own size (an upload) is marked :func:`streamed`: it
reads ``request.stream()`` as the body arrives and bounds it itself; the limit neither
buffers nor bounds its body.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.web.problems import MEDIA_TYPE, Problem

SLACK = 64 * 1024  # the submit's other fields, JSON escapes
_STREAMED = "__conveyor_streamed_body__"

Endpoint = TypeVar("Endpoint", bound=Callable[..., object])


def streamed(endpoint: Endpoint) -> Endpoint:
    """Mark ``endpoint`` as reading its request body as a stream and bounding it itself
    (apply it beneath the route decorator): :class:`BodyLimit` passes its body through as
    it arrives, unbuffered and unbounded."""
    setattr(endpoint, _STREAMED, True)
    return endpoint


def streamed_routes(routes: Iterable[BaseRoute]) -> Callable[[Scope], bool]:
    """Whether a request goes to one of the :func:`streamed` endpoints among ``routes`` (a
    :class:`BodyLimit`'s ``exempt``; a router's own routes, not those of routers it includes)."""
    marked = [r for r in routes if getattr(getattr(r, "endpoint", None), _STREAMED, False)]

    def exempt(scope: Scope) -> bool:
        return any(route.matches(scope)[0] is Match.FULL for route in marked)

    return exempt


def body_limit(max_payload_bytes: int) -> int:
    """The largest request body accepted when payloads are bounded by ``max_payload_bytes``:
    room for the payload written with JSON escapes, so a payload slightly over its bound is
    still answered by the client's own check (413, naming the stage)."""
    return 4 * max_payload_bytes + SLACK


class BodyLimit:
    """ASGI middleware: read a request's body up to ``max_bytes`` (413 past it), then hand
    it to the app in one piece; a request that ``exempt`` says is streamed goes through as
    it is."""

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: Callable[[Scope], bool] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {
            "type": "urn:conveyor:problem:too-large",
            "title": "Content Too Large",
            "status": 413,
            "detail": f"a request body may hold at most {self.max_bytes} bytes",
            "instance": scope.get("path", ""),
        }
        await JSONResponse(body, status_code=413, media_type=MEDIA_TYPE)(scope, receive, send)


class Held:
    """One request held open, counted until :meth:`release` (idempotent)."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self._slots: threading.BoundedSemaphore | None = slots

    def release(self) -> None:
        """Give the slot back (a second call does nothing)."""
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()


class HeldLimit:
    """At most ``size`` requests held open at once in one server process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots = threading.BoundedSemaphore(size)

    def hold(self, what: str) -> Held:
        """A slot for a request held open, or 503 (``busy``, ``Retry-After``) when all are taken."""
        if not self._slots.acquire(blocking=False):
            raise Problem(
                503,
                "busy",
                "Service unavailable",
                f"this server holds {self.size} streams and waits open already ({what} refused); "
                "try again shortly, or another server",
                headers={"Retry-After": "5"},
            )
        return Held(self._slots)


def held_limit(app: FastAPI) -> HeldLimit:
    """The app's bound on requests held open."""
    limit: HeldLimit = app.state.conveyor_held
    return limit


__all__ = ["BodyLimit", "Held", "HeldLimit", "body_limit", "held_limit", "streamed", "streamed_routes"]
