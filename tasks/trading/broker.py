"""The broker client: one page of a user's trade history per call
(``GET /v1/{broker}/trades?since=&cursor=`` with ``Authorization: Bearer <token>``).

Every outcome other than a page is one of the family's errors (``tasks.trading.errors``):
:class:`RateLimited` on 429 (its ``Retry-After``), :class:`BrokerUnauthorized` on 401/403,
:class:`UnreadablePage` when a 200's body is not the JSON envelope, :class:`PeerUnavailable`
on 5xx, timeouts and connection errors, :class:`conveyor.errors.PermanentError` on any other
status. The client never sleeps and never retries (the stage defers instead), and no message
carries the token or a row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import date
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, Self

import httpx

from conveyor.errors import PermanentError
from tasks.trading.errors import BrokerUnauthorized, PeerUnavailable, RateLimited, UnreadablePage
from tasks.trading.transport import http_client

__all__ = ["DEFAULT_RETRY_AFTER", "BrokerClient", "Page", "parse_retry_after"]

DEFAULT_RETRY_AFTER = 1.0


@dataclass(frozen=True)
class Page:
    """One page of trades: ``rows`` verbatim JSON values (well-formed or not), ``next`` the
    cursor of the following page (``None``: the last), ``percent`` the broker's progress,
    ``remaining``/``reset_s`` its ``X-RateLimit-Remaining``/``-Reset`` headers (``None`` when
    absent), ``number`` the 1-based page number within this traversal (as the caller gave it)."""

    rows: list[Any]
    next: str | None
    percent: float | None
    remaining: int | None
    reset_s: float | None
    number: int


class BrokerClient:
    """A synchronous client of the broker peer's (or a broker's) trades endpoint at
    ``base_url``; no automatic retries. Close it, or use it as a context manager."""

    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        self._client = http_client(timeout, base_url.rstrip("/"))

    def fetch_page(self, broker: str, token: str, since: date, cursor: str | None, *, number: int) -> Page:
        """The page at ``cursor`` (``None``: the first) of the trades since ``since``; ``number``
        names the page in errors and in the result. Raises the errors of the module's docstring."""
        params = {"since": since.isoformat()}
        if cursor is not None:
            params["cursor"] = cursor
        try:
            response = self._client.get(
                f"/v1/{broker}/trades", params=params, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.TimeoutException as exc:
            raise PeerUnavailable(f"broker {broker} timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"broker {broker} could not be reached ({type(exc).__name__})") from None
        status = response.status_code
        if status == 429:
            raise RateLimited(parse_retry_after(response.headers.get("Retry-After")), source="broker")
        if status in (401, 403):
            raise BrokerUnauthorized(f"{broker} refused the token (HTTP {status})")
        if status >= 500:
            raise PeerUnavailable(f"broker {broker} answered HTTP {status}")
        if status != 200:
            raise PermanentError(f"broker {broker} refused the request for page {number} (HTTP {status})")
        return _page(broker, number, response)

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def parse_retry_after(value: str | None, *, now: float | None = None) -> float:
    """Seconds to wait from a ``Retry-After`` header: a number of seconds (fractions allowed)
    or an HTTP-date (relative to ``now``, a Unix time, by default the clock); absent or
    unreadable → :data:`DEFAULT_RETRY_AFTER`. Never negative."""
    if value is None or not value.strip():
        return DEFAULT_RETRY_AFTER
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return DEFAULT_RETRY_AFTER
        if when.tzinfo is None:
            return DEFAULT_RETRY_AFTER
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return DEFAULT_RETRY_AFTER
    return max(0.0, seconds)


def _page(broker: str, number: int, response: httpx.Response) -> Page:
    unreadable = f"{broker} page {number} is not readable JSON"
    try:
        body = response.json()
    except ValueError:
        raise UnreadablePage(f"{unreadable} (the body does not parse)") from None
    if not isinstance(body, dict) or not isinstance(body.get("trades"), list):
        raise UnreadablePage(f"{unreadable} (no trades list)")
    next_cursor = body.get("next")
    if next_cursor is not None and (not isinstance(next_cursor, str) or not next_cursor):
        raise UnreadablePage(f"{unreadable} (next is not a cursor)")
    percent = body.get("percent")
    if percent is not None:
        if isinstance(percent, bool) or not isinstance(percent, int | float) or not math.isfinite(percent):
            raise UnreadablePage(f"{unreadable} (percent is not a number)")
        percent = min(100.0, max(0.0, float(percent)))
    return Page(
        rows=body["trades"],
        next=next_cursor,
        percent=percent,
        remaining=_int_header(response.headers.get("X-RateLimit-Remaining")),
        reset_s=_float_header(response.headers.get("X-RateLimit-Reset")),
        number=number,
    )


def _int_header(value: str | None) -> int | None:
    seconds = _float_header(value)
    return int(seconds) if seconds is not None else None


def _float_header(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return max(0.0, number) if math.isfinite(number) else None
