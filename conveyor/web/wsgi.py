"""The HTTP API inside a WSGI application (a Flask app, a Django project's ``wsgi.py``):
:func:`mount` answers the requests under a path prefix with :func:`conveyor.web.create_app`'s
application, run by ``a2wsgi``'s ``ASGIMiddleware`` (its own event loop, in a thread),
and hands every other request to the application it wraps.

The API's application is built at the first request under the prefix, around the client
the caller's ``client()`` returns then (the framework's own), so nothing connects when
the module that mounts it is imported; it is built again if ``client()`` later returns
another client (Django's ``conveyor.contrib.django.close()`` makes a new one).

Under the prefix the API sees the prefix as its ``root_path`` (``SCRIPT_NAME`` plus the
prefix): ``Location`` headers, ``next`` links and ``/docs`` name the prefixed paths.
Server-Sent Events (``/events/stream``) pass through as they are written, each stream
holding one of the server's threads until the client goes; see the README.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

    from conveyor.client.by_name import Client

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]
API_KEY = "conveyor.api"  # the environ key the WSGI side leaves the request's application under
TASK_KEY = "conveyor.api_task"  # and the ASGI side its task under


def clean_prefix(prefix: str) -> str:
    """``prefix`` as a path: one leading slash, none trailing (``"conveyor/"`` is
    ``"/conveyor"``). The root itself is refused: the API would hide the whole app."""
    cleaned = "/" + prefix.strip().strip("/")
    if cleaned == "/":
        raise ValueError("mount the API under a prefix such as '/conveyor', not at the root")
    return cleaned


class LazyAPI:
    """A WSGI application: the HTTP API around ``client()``, built at its first request."""

    def __init__(self, client: Callable[[], Client]) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._wsgi: Any = None  # a2wsgi's ASGIMiddleware
        self._built_on: Client | None = None
        self._api: FastAPI | None = None

    @property
    def application(self) -> FastAPI:
        """The API's application for the current client (built now if it is not yet)."""
        current = self._client()
        api = self._api
        if api is not None and self._built_on is current:
            return api
        from conveyor.web.app import create_app
        from conveyor.web.events import streams_end

        with self._lock:
            if self._api is None or self._built_on is not current:
                if self._api is not None:
                    streams_end(self._api).set()  # its client is closed: its streams end
                self._api, self._built_on = create_app(current), current
            return self._api

    @staticmethod
    async def _asgi(scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI side: the API's application the WSGI side chose for this request."""
        environ = scope["wsgi_environ"]
        environ[TASK_KEY] = asyncio.current_task()
        await environ[API_KEY](scope, receive, send)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        api = self.application  # in the server's thread: Django's client follows its test database
        if self._wsgi is None:
            with self._lock:
                if self._wsgi is None:
                    from a2wsgi import ASGIMiddleware

                    # a2wsgi types its own scope and environ: ours are the plain ones.
                    asgi: Any = self._asgi
                    self._wsgi = ASGIMiddleware(asgi)
        environ[API_KEY] = api
        return _Response(self._wsgi(environ, start_response), environ, self._wsgi.loop)


class _Response:
    """The API's answer as the WSGI server iterates it. Closed by the server (when the
    answer is complete, or when the client went away mid-stream), it also ends the API's
    task: a2wsgi leaves an event stream whose client is gone waiting forever to send."""

    def __init__(self, chunks: Iterable[bytes], environ: Environ, loop: asyncio.AbstractEventLoop) -> None:
        self._chunks = chunks
        self._environ = environ
        self._loop = loop

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._chunks)

    def close(self) -> None:
        try:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
        finally:
            task: asyncio.Task[Any] | None = self._environ.get(TASK_KEY)
            if task is not None:
                self._loop.call_soon_threadsafe(task.cancel)


class Mounted:
    """A WSGI application: ``app`` with the HTTP API under ``prefix``. A request whose
    path is the prefix or below it goes to the API (``SCRIPT_NAME`` gains the prefix,
    ``PATH_INFO`` keeps the rest); every other one to ``app``, unchanged."""

    def __init__(self, app: WSGIApp, prefix: str, client: Callable[[], Client]) -> None:
        self.app = app
        self.prefix = clean_prefix(prefix)
        self.api = LazyAPI(client)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "") or ""
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            return self.app(environ, start_response)
        environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + self.prefix
        environ["PATH_INFO"] = path[len(self.prefix) :]
        return self.api(environ, start_response)


def mount(app: WSGIApp, prefix: str, client: Callable[[], Client]) -> Mounted:
    """``app`` with the HTTP API on ``client()`` under ``prefix`` (see :class:`Mounted`)."""
    return Mounted(app, prefix, client)


__all__ = ["LazyAPI", "Mounted", "clean_prefix", "mount"]
