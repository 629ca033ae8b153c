"""What the trading peers share: a stdlib ``ThreadingHTTPServer`` on loopback, served from
a daemon thread, started and stopped (and restarted on the same port) the same way."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self


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


__all__ = ["LoopbackPeer"]
