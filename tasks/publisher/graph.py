"""The Graph connector: Facebook page posts and Instagram media through a Meta-Graph-like
HTTP API (stdlib ``http.client``, JSON bodies, ``Authorization: Bearer <token>``).

Every failure is one of two errors, mapped onto the platform's retry policy:

- :class:`GraphTransient` (retry later): HTTP 429 (``retry_after`` from ``Retry-After``);
  a 4xx whose Graph error code is a throttling one (4, 17, 32, 613) or that says
  ``is_transient: true``; any 5xx; a connection refused, reset or timed out; a reply that is
  not the JSON expected. After a POST went out and no usable reply came back the object may
  exist: callers look for it (:meth:`GraphClient.find_feed_post`,
  :meth:`GraphClient.find_media`) before posting again, since Graph has no idempotency keys.
- :class:`GraphRefused` (retrying cannot help): any other 4xx, e.g. code 100 (invalid
  parameter) or 190 (bad token).

Messages are one line naming the request, the status, Graph's error code and its short
message; never the token, never a caption or comment text, never a query string (Graph's
paging URLs carry ``access_token``). Pure: no Conveyor services.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from conveyor.errors import PermanentError, TransientError

__all__ = [
    "THROTTLING_CODES",
    "GraphClient",
    "GraphRefused",
    "GraphTransient",
    "format_graph_time",
    "parse_graph_time",
]

THROTTLING_CODES = frozenset({4, 17, 32, 613})
# Graph's clock and ours differ a little; a post made "at" since may carry an earlier second.
CLOCK_SKEW = timedelta(seconds=5)
_MAX_GRAPH_MESSAGE = 200
_MAX_PAGES = 10
_PAGE_SIZE = 100


class GraphTransient(TransientError):
    """The request may succeed later. ``status``: the HTTP status (``None``: no reply);
    ``code``: Graph's error code; ``retry_after``: seconds Graph asked us to wait."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


class GraphRefused(PermanentError):
    """Graph refused the request for good (bad token, invalid parameter, unknown object)."""

    def __init__(self, message: str, *, status: int | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def parse_graph_time(value: str) -> datetime:
    """An aware UTC datetime from Graph's ISO 8601 (``2025-01-02T03:04:05+0000``, ``+00:00``
    or ``Z``); a value without an offset is taken as UTC."""
    parsed = datetime.fromisoformat(value.strip())
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def format_graph_time(moment: datetime) -> str:
    """``moment`` the way Graph writes it: ``2025-01-02T03:04:05+0000`` (naive means UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S+0000")


class GraphClient:
    """A client of one Graph API base URL (``http://host:port`` or with a version prefix,
    ``https://graph.facebook.com/v19.0``) acting with one access token."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http(s) URL")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self.timeout = timeout

    def __repr__(self) -> str:
        scheme = "https" if self._https else "http"
        port = f":{self._port}" if self._port else ""
        return f"GraphClient({scheme}://{self._host}{port}{self._prefix})"

    # Facebook

    def post_feed(self, account: str, message: str, link: str | None = None) -> str:
        """Publish a page post; returns its id. Not idempotent: after a
        :class:`GraphTransient` look for it with :meth:`find_feed_post` first."""
        body: dict[str, Any] = {"message": message}
        if link is not None:
            body["link"] = link
        return _id_of(self._call("POST", f"/{_seg(account)}/feed", body=body), "POST", f"/{account}/feed")

    def find_feed_post(self, account: str, message: str, since: datetime) -> str | None:
        """The id of the newest post of ``account`` whose message is exactly ``message`` and
        created at or after ``since`` (less the clock skew), or ``None``."""
        path = f"/{_seg(account)}/feed"
        query = {"fields": "id,message,created_time", "limit": str(_PAGE_SIZE)}
        items = self._list(path, query, "created_time", since)
        return _newest(items, "message", message, "created_time", since)

    # Instagram

    def create_container(self, account: str, caption: str, image_url: str) -> str:
        """Create a media container (Graph prepares the image); returns the container id."""
        body = {"caption": caption, "image_url": image_url}
        path = f"/{_seg(account)}/media"
        return _id_of(self._call("POST", path, body=body), "POST", path)

    def container_status(self, container_id: str) -> str:
        """The container's ``status_code``: FINISHED, IN_PROGRESS, PUBLISHED, EXPIRED or ERROR."""
        path = f"/{_seg(container_id)}"
        answer = self._call("GET", path, query={"fields": "status_code"})
        status = answer.get("status_code")
        if not isinstance(status, str) or not status:
            raise GraphTransient(f"GET {path} answered without a status_code")
        return status

    def media_publish(self, account: str, creation_id: str) -> str:
        """Publish a FINISHED container; returns the media id. Not idempotent: after a
        :class:`GraphTransient` check :meth:`container_status` / :meth:`find_media` first."""
        path = f"/{_seg(account)}/media_publish"
        return _id_of(self._call("POST", path, body={"creation_id": creation_id}), "POST", path)

    def find_media(self, account: str, caption: str, since: datetime) -> str | None:
        """The id of the newest media of ``account`` whose caption is exactly ``caption`` and
        published at or after ``since`` (less the clock skew), or ``None``."""
        path = f"/{_seg(account)}/media"
        query = {"fields": "id,caption,timestamp", "limit": str(_PAGE_SIZE)}
        return _newest(self._list(path, query, "timestamp", since), "caption", caption, "timestamp", since)

    def list_comments(self, media_id: str) -> list[dict[str, str]]:
        """The comments on a media: ``[{"id", "text"}]`` (every page)."""
        path = f"/{_seg(media_id)}/comments"
        comments: list[dict[str, str]] = []
        for item in self._list(path, {"fields": "id,text", "limit": str(_PAGE_SIZE)}, None, None):
            if "id" in item:
                comments.append({"id": str(item["id"]), "text": str(item.get("text") or "")})
        return comments

    def post_comment(self, media_id: str, message: str) -> str:
        """Comment on a media; returns the comment id. Not idempotent (see
        :meth:`list_comments`)."""
        path = f"/{_seg(media_id)}/comments"
        return _id_of(self._call("POST", path, body={"message": message}), "POST", path)

    # HTTP

    def _list(
        self, path: str, query: Mapping[str, str], time_field: str | None, since: datetime | None
    ) -> Iterator[dict[str, Any]]:
        """The items of a listing, following ``paging.next`` (newest first: stops at the first
        page reaching back before ``since``)."""
        threshold = _threshold(since) if since is not None else None
        answer = self._call("GET", path, query=query)
        for _ in range(_MAX_PAGES):
            data = answer.get("data")
            if not isinstance(data, list):
                raise GraphTransient(f"GET {path} answered without a data list")
            older = False
            for item in data:
                if not isinstance(item, dict):
                    continue
                yield item
                if threshold is not None and time_field is not None:
                    moment = _time_of(item, time_field)
                    older = older or (moment is not None and moment < threshold)
            paging = answer.get("paging")
            next_url = paging.get("next") if isinstance(paging, dict) else None
            if older or not data or not isinstance(next_url, str) or not next_url:
                return
            parts = urlsplit(next_url)
            # The next page's URL is followed on our own host: its path and query only.
            answer = self._call("GET", parts.path, raw_query=parts.query, prefixed=False)

    def _connection(self) -> http.client.HTTPConnection:
        if self._https:
            context = ssl.create_default_context()
            return http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=context)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        raw_query: str = "",
        prefixed: bool = True,
    ) -> dict[str, Any]:
        """One request; the decoded JSON object of a 2xx reply, else the error it means."""
        full_path = (self._prefix + path) if prefixed else path
        target = full_path
        if query:
            target += "?" + urlencode(query)
        elif raw_query:
            target += "?" + raw_query
        name = f"{method} {full_path}"
        headers = {"Accept": "application/json", "Authorization": f"Bearer {self._token}"}
        data: bytes | None = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise GraphTransient(
                    f"{name}: the Graph API could not be reached ({type(exc).__name__})"
                ) from None
            try:
                conn.request(method, target, body=data, headers=headers)
                response = conn.getresponse()
                status = response.status
                retry_after = response.getheader("Retry-After")
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise GraphTransient(
                    f"{name}: no reply from the Graph API ({type(exc).__name__}); "
                    "the request may have been accepted"
                ) from None
        finally:
            conn.close()
        if 200 <= status < 300:
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise GraphTransient(f"{name} answered {status} with a reply that is not a JSON object")
            return answer
        raise self._error(name, status, retry_after, raw)

    def _error(self, name: str, status: int, retry_after: str | None, raw: bytes) -> Exception:
        """The error a non-2xx reply means (see the module's docstring)."""
        code, transient_flag, graph_message = _graph_error(raw)
        detail = f"{name} answered {status}"
        if code is not None:
            detail += f" (Graph error {code})"
        if graph_message:
            detail += f": {self._scrub(graph_message)}"
        wait = _seconds(retry_after)
        if status == 429 or status >= 500 or not 400 <= status < 500:
            return GraphTransient(detail, status=status, code=code, retry_after=wait)
        if code in THROTTLING_CODES or transient_flag:
            return GraphTransient(detail, status=status, code=code, retry_after=wait)
        return GraphRefused(detail, status=status, code=code)

    def _scrub(self, text: str) -> str:
        """Graph's message on one line, short, and without our token should it quote it."""
        line = " ".join(text.split())
        if self._token:
            line = line.replace(self._token, "***")
        if len(line) > _MAX_GRAPH_MESSAGE:
            line = line[: _MAX_GRAPH_MESSAGE - 1] + "…"
        return line


def _seg(value: str) -> str:
    """One path segment (an account, container or media id), quoted."""
    return quote(str(value), safe="")


def _id_of(answer: dict[str, Any], method: str, path: str) -> str:
    """The ``id`` of a creating POST's answer; without one the object may exist all the same."""
    value = answer.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise GraphTransient(f"{method} {path} answered without an id; the object may have been created")
    return str(value)


def _graph_error(raw: bytes) -> tuple[int | None, bool, str]:
    """Graph's ``error`` object: (code, is_transient, message); blanks when there is none."""
    try:
        answer = json.loads(raw)
    except ValueError:
        return None, False, ""
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict):
        return None, False, ""
    code = error.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if not isinstance(code, int) or isinstance(code, bool):
        code = None
    message = error.get("message")
    return code, error.get("is_transient") is True, message if isinstance(message, str) else ""


def _seconds(header: str | None) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is not used by Graph: ignored)."""
    if header is None:
        return None
    try:
        value = float(header.strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def _threshold(since: datetime) -> datetime:
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    return since.astimezone(UTC) - CLOCK_SKEW


def _time_of(item: Mapping[str, Any], field: str) -> datetime | None:
    value = item.get(field)
    if not isinstance(value, str):
        return None
    try:
        return parse_graph_time(value)
    except ValueError:
        return None


def _newest(
    items: Iterator[dict[str, Any]], text_field: str, text: str, time_field: str, since: datetime
) -> str | None:
    """The id of the newest item whose ``text_field`` is exactly ``text`` and whose
    ``time_field`` is at or after ``since`` less the clock skew."""
    threshold = _threshold(since)
    best: tuple[datetime, str] | None = None
    for item in items:
        moment = _time_of(item, time_field)
        if moment is None or moment < threshold or item.get(text_field) != text or "id" not in item:
            continue
        if best is None or moment > best[0]:
            best = (moment, str(item["id"]))
    return best[1] if best is not None else None
