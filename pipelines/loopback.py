"""What the local peers share (trading, operations): a stdlib ``ThreadingHTTPServer`` on
loopback, served from a daemon thread, started and stopped (and restarted on the same
port) the same way."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self


class LoopbackPeer:
    """A peer's lifecycle: :meth:`start` binds ``host``/``port`` (0: a free port) and serves
    in a daemon thread, :meth:`stop` closes it (idempotent; :meth:`start` listens again on
    the same port); a context manager. Subclasses give :meth:`handler_class` and ``name``."""

    name = "peer"

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The peer's base URL."""
        return f"http://{self.host}:{self.port}"

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The request handler serving this peer."""
        raise NotImplementedError

    def start(self) -> Self:
        """Bind (a free port when ``port`` is 0) and serve in a daemon thread; returns the peer."""
        server = ThreadingHTTPServer((self.host, self.port), self.handler_class())
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name=f"{self.name}-peer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (idempotent; state is kept)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PeerError(Exception):
    """An answer other than 200: ``status``, a message for the JSON body, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (empty: ``{}``); else a 400."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise PeerError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise PeerError(400, "the body must be a JSON object")
    return body


def content_length(handler: BaseHTTPRequestHandler, limit: int) -> int:
    """The request's body length; an unreadable or negative one reads as over ``limit``."""
    try:
        length = int(handler.headers.get("Content-Length") or 0)
    except ValueError:
        return limit + 1
    return length if length >= 0 else limit + 1


def quiet_handler(handle: Callable[[BaseHTTPRequestHandler, str], None]) -> type[BaseHTTPRequestHandler]:
    """A keep-alive handler class passing every GET, POST, PUT and DELETE to ``handle``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes on a kept-alive connection: with Nagle's
        # algorithm and the client's delayed ACK each answer would wait ~40 ms more.
        disable_nagle_algorithm = True

        def _serve(self) -> None:
            handle(self, self.command)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the peers keep their own request logs and stats

    return Handler


__all__ = ["LoopbackPeer", "PeerError", "content_length", "json_object", "quiet_handler"]
