"""Waiting at start for a service that does not answer yet: Redis, Postgres.

A worker, ``conveyor up`` or ``demo`` started while one of Conveyor's own services is
unreachable (a restart, pods started in no order) waits for it instead of exiting:
nothing may restart the process, and the jobs would wait for it anyway. It says what it
waits for (the URL without its password) at each try, tries again after a pause that
grows to :data:`MAX_PAUSE`, and goes on once the service answers. Only an outage is waited
for: any other error (a wrong password, a Redis that may evict keys, a missing database)
is raised as before. Celery's own broker connection waits the same way (kombu's retries,
``broker_connection_retry_on_startup`` and ``broker_connection_max_retries=None``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, text

from conveyor.errors import describe, is_connection_loss
from conveyor.logs import redact_text

log = logging.getLogger("conveyor.startup")

T = TypeVar("T")

FIRST_PAUSE = 0.5
MAX_PAUSE = 5.0


def without_password(url: str) -> str:
    """``url`` with its password left out (``redis://:pw@host:6379/0`` → ``redis://host:6379/0``),
    and any other secret it carries masked."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return redact_text(url)
    if password is not None:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        user = f"{parts.username}@" if parts.username else ""
        port = f":{parts.port}" if parts.port else ""
        url = urlunsplit(parts._replace(netloc=f"{user}{host}{port}"))
    return redact_text(url)


def redis_at(url: str | None) -> str:
    """How a wait names Redis: ``Redis at redis://host:6379/0``."""
    return f"Redis at {without_password(url or '')}"


def database_at(url: str | None) -> str:
    """How a wait names the database: ``Postgres at postgresql://user@host:5432/db``."""
    shown = without_password(url or "")
    return f"{'SQLite' if shown.startswith('sqlite') else 'Postgres'} at {shown}"


def redis_outage(exc: BaseException) -> bool:
    """Redis does not answer (refused, timed out, still loading its data); a refused
    password is not an outage."""
    return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) and not (
        isinstance(exc, redis.exceptions.AuthenticationError)
    )


def quick_redis(url: str, timeout: float = 5.0) -> Redis:
    """A Redis client of its own whose every try is short and never retried: a black-holed
    server fails it in seconds (the shared client's socket timeout is 30 s, retried), so the
    wait's status lines and liveness ticks go on."""
    return Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def database_answers(engine: Engine) -> None:
    """One round trip to the database (raises while it is unreachable)."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def wait_for(
    what: str,
    attempt: Callable[[], T],
    *,
    outage: Callable[[BaseException], bool] = is_connection_loss,
    say: Callable[[str], None] = log.warning,
    each_second: Callable[[str], None] | None = None,
) -> T:
    """Run ``attempt`` until it does not fail with an ``outage`` of ``what`` (another error
    is raised), saying at each miss what it waits for and why; returns its result.

    ``each_second`` is called with the status about every second of the pauses: a liveness
    tick, and a chance to raise (a shutdown asked for meanwhile).
    """
    started: float | None = None
    pause = FIRST_PAUSE
    while True:
        try:
            result = attempt()
        except Exception as exc:
            if not outage(exc):
                raise
            now = time.monotonic()
            started = now if started is None else started
            status = f"waiting for {what}"
            detail = redact_text((describe(exc).splitlines() or [""])[0]).rstrip(".")
            say(f"{status}: {detail}; {now - started:.0f} s so far, next try in {pause:g} s")
            _pause(pause, status, each_second)
            pause = min(MAX_PAUSE, pause * 2)
            continue
        if started is not None:
            say(f"{what} answers after {time.monotonic() - started:.0f} s")
        return result


def _pause(seconds: float, status: str, each_second: Callable[[str], None] | None) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if each_second is not None:
            each_second(status)
        time.sleep(min(1.0, left))


__all__ = [
    "database_answers",
    "database_at",
    "quick_redis",
    "redis_at",
    "redis_outage",
    "wait_for",
    "without_password",
]
