"""A local stand-in for the Meta Graph API (stdlib ``ThreadingHTTPServer``), for the tests,
demos and benchmarks of the publisher family: Facebook page posts, Instagram containers,
media and comments, faults on demand, and a record of every request's timing.

Like Graph it has no idempotency: every accepted POST creates a new object, so a client that
posts again after an unknown outcome makes a duplicate the tests can see.

``python -m pipelines.publisher.peers --port N [--latency-ms X]`` serves it in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from pipelines.email.peers import free_port

__all__ = ["GraphPeer", "RequestRecord"]

_DEFAULT_LIMIT = 25
_THROTTLING = (4, 17, 32, 613)


@dataclass
class RequestRecord:
    """One request the peer served: ``target`` is the account or object id of its path,
    ``channel`` ``facebook`` (``/feed``) or ``instagram``; ``started``/``ended`` are
    ``time.monotonic()`` (``ended`` and ``status`` are ``None`` while in flight)."""

    method: str
    path: str
    target: str
    channel: str
    started: float
    ended: float | None = None
    status: int | None = None


@dataclass
class _Fault:
    remaining: int
    status: int
    code: int | None
    retry_after: float | None
    path_contains: str | None
    is_transient: bool | None


class _GraphError(Exception):
    def __init__(self, status: int, code: int, message: str, subcode: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.subcode = subcode
        self.is_transient: bool | None = None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S+0000")


class GraphPeer:
    """A Graph-like API on ``host`` and ``port`` (a free one by default); see the module's
    docstring. Settable while serving: ``latency_s`` (every reply waits that long first),
    ``container_ready_s`` (a new container is IN_PROGRESS that long), ``hold_after_accept_s``
    (a creating POST records its object, sets ``accepted``, then waits before replying)."""

    def __init__(
        self,
        token: str = "test-token",
        *,
        latency_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.token = token
        self.latency_s = latency_s
        self.container_ready_s = 0.0
        self.hold_after_accept_s = 0.0
        self.host = host
        self.port = port if port is not None else free_port()
        self.accepted = threading.Event()
        self._lock = threading.Condition()
        self._accepted_count = 0
        self._faults: list[_Fault] = []
        self._requests: list[RequestRecord] = []
        self._posts: list[dict[str, Any]] = []
        self._media: list[dict[str, Any]] = []
        self._comments: dict[str, list[dict[str, Any]]] = {}
        self._containers: dict[str, dict[str, Any]] = {}
        self._next_id = 0
        self._id_base = random.randrange(10**5, 10**6)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL to give :class:`tasks.publisher.graph.GraphClient`."""
        return f"http://{self.host}:{self.port}"

    # Lifecycle

    def start(self) -> GraphPeer:
        """Start serving in a thread; returns the peer."""
        server = ThreadingHTTPServer((self.host, self.port), _handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="graph-peer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def down(self) -> None:
        """Close the listening socket: new connections are refused until :meth:`up`."""
        self.stop()

    def up(self) -> None:
        """Listen again on the same port (the peer's objects are kept)."""
        if self._server is None:
            self.start()

    def __enter__(self) -> GraphPeer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # Switches

    def fail_next(
        self,
        n: int = 1,
        *,
        status: int = 500,
        code: int | None = None,
        retry_after: float | None = None,
        path_contains: str | None = None,
        is_transient: bool | None = None,
    ) -> None:
        """The next ``n`` requests (whose path contains ``path_contains``, if given) answer
        ``status`` with a Graph error (``code``; by default 4 for 429, 2 for 5xx, 100
        otherwise), a ``Retry-After`` header when ``retry_after`` is given, and
        ``is_transient`` in the error when not ``None``. Nothing is created."""
        with self._lock:
            self._faults.append(_Fault(n, status, code, retry_after, path_contains, is_transient))

    def expire(self, container_id: str) -> None:
        """Make a container EXPIRED (Graph expires unpublished containers after 24 h)."""
        with self._lock:
            self._containers[container_id]["status_code"] = "EXPIRED"

    def error(self, container_id: str) -> None:
        """Make a container ERROR (Graph could not process its image)."""
        with self._lock:
            self._containers[container_id]["status_code"] = "ERROR"

    # Observability

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of the requests so far, in arrival order (records of requests still in
        flight are completed in place)."""
        with self._lock:
            return list(self._requests)

    def posts(self, account: str | None = None) -> list[dict[str, Any]]:
        """The Facebook posts (of ``account``), oldest first."""
        with self._lock:
            return [dict(p) for p in self._posts if account is None or p["account"] == account]

    def media(self, account: str | None = None) -> list[dict[str, Any]]:
        """The published Instagram media (of ``account``), oldest first."""
        with self._lock:
            return [dict(m) for m in self._media if account is None or m["account"] == account]

    def comments(self, media_id: str) -> list[dict[str, Any]]:
        """The comments on a media, oldest first."""
        with self._lock:
            return [dict(c) for c in self._comments.get(media_id, [])]

    @property
    def containers(self) -> dict[str, dict[str, Any]]:
        """A snapshot of the containers by id, each with its current ``status_code``."""
        with self._lock:
            return {
                cid: {**{k: v for k, v in c.items() if k != "_ready_at"}, "status_code": self._status(c)}
                for cid, c in self._containers.items()
            }

    def wait_accepted(self, n: int = 1, timeout: float = 10.0) -> bool:
        """Whether at least ``n`` objects were created by POSTs within ``timeout`` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: self._accepted_count >= n, timeout)

    def max_overlap(self, predicate: Callable[[RequestRecord], bool] = lambda r: True) -> int:
        """The most requests matching ``predicate`` ever in flight at once (a request still in
        flight counts as not yet ended)."""
        events: list[tuple[float, int]] = []
        for record in self.requests:
            if predicate(record):
                events.append((record.started, 1))
                events.append((record.ended if record.ended is not None else float("inf"), -1))
        # At equal times an end sorts before a start: touching intervals do not overlap.
        events.sort()
        current = best = 0
        for _, delta in events:
            current += delta
            best = max(best, current)
        return best

    # Serving (called from the handler's threads)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"1784{self._id_base}{self._next_id:07d}"

    def _status(self, container: dict[str, Any]) -> str:
        status = str(container["status_code"])
        if status == "IN_PROGRESS" and time.monotonic() >= container["_ready_at"]:
            return "FINISHED"
        return status

    def _begin(self, method: str, path: str) -> RequestRecord:
        parts = _parts(path)
        channel = "facebook" if parts[-1:] == ["feed"] else "instagram"
        record = RequestRecord(method, path, parts[0] if parts else "", channel, time.monotonic())
        with self._lock:
            self._requests.append(record)
        return record

    def _fault(self, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.path_contains is None or fault.path_contains in path:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def _accept(self) -> None:
        self._accepted_count += 1
        self.accepted.set()
        self._lock.notify_all()

    def _answer(
        self, method: str, path: str, parts: list[str], query: dict[str, str], body: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The JSON answer and whether an object was created (the caller holds it back by
        ``hold_after_accept_s``); raises :class:`_GraphError`."""
        with self._lock:
            if len(parts) == 2 and parts[1] == "feed":
                if method == "POST":
                    return self._create_post(parts[0], body), True
                return self._listing(path, self._posts, parts[0], "created_time", query), False
            if len(parts) == 2 and parts[1] == "media":
                if method == "POST":
                    return self._create_container(parts[0], body), False
                return self._listing(path, self._media, parts[0], "timestamp", query), False
            if len(parts) == 2 and parts[1] == "media_publish" and method == "POST":
                return self._publish(parts[0], body), True
            if len(parts) == 2 and parts[1] == "comments":
                return self._comment(method, path, parts[0], body, query)
            if len(parts) == 1 and method == "GET" and parts[0] in self._containers:
                container = self._containers[parts[0]]
                return {"id": parts[0], "status_code": self._status(container)}, False
            raise _GraphError(400, 100, f"Unsupported {method.lower()} request. Object does not exist.", 33)

    def _create_post(self, account: str, body: dict[str, Any]) -> dict[str, Any]:
        message, link = body.get("message"), body.get("link")
        if not isinstance(message, str) or not message:
            raise _GraphError(400, 100, "(#100) The parameter message is required")
        post = {"id": self._new_id(), "account": account, "message": message}
        if link is not None:
            post["link"] = str(link)
        post["created_time"] = _now()
        self._posts.append(post)
        self._accept()
        return {"id": post["id"]}

    def _create_container(self, account: str, body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("image_url"):
            raise _GraphError(400, 100, "(#100) The parameter image_url is required")
        container_id = self._new_id()
        self._containers[container_id] = {
            "id": container_id,
            "account": account,
            "caption": str(body.get("caption") or ""),
            "image_url": str(body["image_url"]),
            "status_code": "IN_PROGRESS",
            "_ready_at": time.monotonic() + self.container_ready_s,
        }
        return {"id": container_id}

    def _publish(self, account: str, body: dict[str, Any]) -> dict[str, Any]:
        container = self._containers.get(str(body.get("creation_id") or ""))
        if container is None or container["account"] != account:
            raise _GraphError(400, 100, "(#100) The parameter creation_id is invalid")
        status = self._status(container)
        if status == "PUBLISHED":
            raise _GraphError(400, 100, "(#100) The media container was already published")
        if status != "FINISHED":
            raise _GraphError(400, 9007, f"Media ID is not available (container {status})", 2207027)
        container["status_code"] = "PUBLISHED"
        caption = container["caption"]
        media = {"id": self._new_id(), "account": account, "caption": caption, "timestamp": _now()}
        self._media.append(media)
        self._comments[media["id"]] = []
        self._accept()
        return {"id": media["id"]}

    def _comment(
        self, method: str, path: str, media_id: str, body: dict[str, Any], query: dict[str, str]
    ) -> tuple[dict[str, Any], bool]:
        if media_id not in self._comments:
            raise _GraphError(400, 100, "Unsupported request. Object does not exist.", 33)
        if method == "GET":
            return self._listing(path, self._comments[media_id], None, None, query), False
        message = body.get("message")
        if not isinstance(message, str) or not message:
            raise _GraphError(400, 100, "(#100) The parameter message is required")
        comment = {"id": self._new_id(), "media_id": media_id, "text": message}
        self._comments[media_id].append(comment)
        self._accept()
        return {"id": comment["id"]}, True

    def _listing(
        self,
        path: str,
        items: list[dict[str, Any]],
        account: str | None,
        time_field: str | None,
        query: dict[str, str],
    ) -> dict[str, Any]:
        """A Graph listing page: ``data`` (newest first when timed), ``paging`` by offset."""
        chosen = [i for i in items if account is None or i.get("account") == account]
        if time_field is not None:
            chosen.reverse()
        limit = int(query.get("limit") or _DEFAULT_LIMIT)
        offset = int(query.get("after") or 0)
        fields = set((query.get("fields") or "").split(",")) - {""}
        hidden = {"account", "media_id"}
        page = [
            {k: v for k, v in i.items() if k not in hidden and (not fields or k in fields)} for i in chosen
        ]
        answer: dict[str, Any] = {"data": page[offset : offset + limit]}
        if offset + limit < len(chosen):
            after = {**query, "after": str(offset + limit)}
            answer["paging"] = {
                "cursors": {"after": after["after"]},
                "next": f"{self.url}{path}?{urlencode(after)}",
            }
        return answer

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        """Serve one request: record it, wait ``latency_s``, then fault, token, route."""
        split = urlsplit(handler.path)
        record = self._begin(method, split.path)
        status = 500
        try:
            length = int(handler.headers.get("Content-Length") or 0)
            raw = handler.rfile.read(length) if length else b""
            if self.latency_s:
                time.sleep(self.latency_s)
            query = dict(parse_qsl(split.query))
            created = False
            headers: dict[str, str] = {}
            try:
                fault = self._fault(split.path)
                if fault is not None:
                    if fault.retry_after is not None:
                        headers["Retry-After"] = f"{fault.retry_after:g}"
                    raise _fault_error(fault)
                auth = handler.headers.get("Authorization") or ""
                token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else query.get("access_token")
                if token != self.token:
                    raise _GraphError(400, 190, "Invalid OAuth access token - Cannot parse access token")
                body = _body(raw, query)
                answer, created = self._answer(method, split.path, _parts(split.path), query, body)
                status = 200
            except _GraphError as exc:
                status, answer = exc.status, _error_body(exc)
            if created and self.hold_after_accept_s:
                time.sleep(self.hold_after_accept_s)  # created and recorded; the reply is late
            data = json.dumps(answer).encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            with self._lock:  # stamped before the reply leaves: the client's next request starts later
                record.ended, record.status = time.monotonic(), status
            handler.wfile.write(data)
        except OSError:
            handler.close_connection = True  # the client went away (killed while we held the reply)
        finally:
            with self._lock:
                if record.ended is None:
                    record.ended, record.status = time.monotonic(), status


def _parts(path: str) -> list[str]:
    """A path's segments, without a version prefix (``/v19.0/...``)."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0][:1] == "v" and parts[0][1:].replace(".", "").isdigit():
        return parts[1:]
    return parts


def _fault_error(fault: _Fault) -> _GraphError:
    code = fault.code
    if code is None:
        code = 4 if fault.status == 429 else 2 if fault.status >= 500 else 100
    message = f"(#{code}) Request limit reached" if code in _THROTTLING else f"Fault {fault.status}"
    error = _GraphError(fault.status, code, message)
    error.is_transient = fault.is_transient
    return error


def _error_body(exc: _GraphError) -> dict[str, Any]:
    error: dict[str, Any] = {
        "message": exc.message,
        "type": "OAuthException" if exc.code in (190, *_THROTTLING) else "GraphMethodException",
        "code": exc.code,
    }
    if exc.subcode is not None:
        error["error_subcode"] = exc.subcode
    if exc.is_transient is not None:
        error["is_transient"] = exc.is_transient
    return {"error": error}


def _body(raw: bytes, query: dict[str, str]) -> dict[str, Any]:
    """A POST's parameters: its JSON object, else (like Graph) its query string."""
    if not raw.strip():
        return {k: v for k, v in query.items() if k != "access_token"}
    try:
        body = json.loads(raw)
    except ValueError:
        raise _GraphError(400, 100, "(#100) The request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _GraphError(400, 100, "(#100) The request body must be a JSON object")
    return body


def _handler(peer: GraphPeer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes on a kept-alive connection: with Nagle's
        # algorithm and the client's delayed ACK each answer would wait ~40 ms more.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            peer._handle(self, "GET")

        def do_POST(self) -> None:
            peer._handle(self, "POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the tests' output stays readable; peer.requests records every request

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve a :class:`GraphPeer` in the foreground until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.publisher.peers", description=__doc__)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--token", default="test-token")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--container-ready-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    peer = GraphPeer(args.token, latency_s=args.latency_ms / 1000, port=args.port)
    peer.container_ready_s = args.container_ready_s
    with peer, contextlib.suppress(KeyboardInterrupt):
        print(peer.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
