"""Redis on the submit path: asked briefly, and skipped while it does not answer.

Submit needs Postgres only. Everything it asks Redis (the dedup cache, the broker epoch,
the publish, a preemption flag) is a fast path whose answer Postgres can give or the
relay can make up for. So each call gets a short socket timeout and no retry, and a call
that fails opens a breaker: for ``cooldown`` seconds no submit in this process asks Redis
again. A web app whose Redis is stopped, or frozen (a SIGSTOPped server accepts
connections and never answers), pays one timeout, then none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kombu.exceptions import KombuError
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from conveyor.errors import NotRunning

log = logging.getLogger("conveyor")
T = TypeVar("T")


class FastPath:
    """A short-timeout Redis client behind a breaker."""

    def __init__(self, url: Callable[[], str | None], *, timeout: float, cooldown: float) -> None:
        self._url = url
        self.timeout = timeout
        self.cooldown = cooldown
        self._client: Redis | None = None
        self._pid = os.getpid()
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """Whether Redis failed to answer within the last ``cooldown`` seconds."""
        return time.monotonic() < self._open_until

    def trip(self, why: BaseException | str, *, service: str = "Redis") -> None:
        """Stop asking Redis (and the broker) for ``cooldown`` seconds; ``service`` is the
        one that failed, for the log."""
        if not self.down:
            log.warning(
                "%s did not answer a submit (%s): submits go to Postgres only for %gs",
                service,
                why,
                self.cooldown,
            )
        self._open_until = time.monotonic() + self.cooldown

    def client(self) -> Redis:
        """This process's short-timeout client (no retries: a retry doubles the wait)."""
        if self._pid != os.getpid():
            self._client, self._pid, self._open_until = None, os.getpid(), 0.0
        if self._client is None:
            with self._lock:
                if self._client is None:
                    url = self._url()
                    if not url:
                        raise NotRunning("no Redis configured: run `conveyor up` or set CONVEYOR_REDIS_URL")
                    self._client = Redis.from_url(
                        url,
                        socket_timeout=self.timeout,
                        socket_connect_timeout=self.timeout,
                        retry=Retry(NoBackoff(), 0),
                        health_check_interval=0,
                    )
        return self._client

    def attempt(self, fn: Callable[[Redis], T]) -> T | None:
        """``fn(client)``, or None if Redis is skipped or fails (which trips the breaker)."""
        if self.down:
            return None
        try:
            return fn(self.client())
        except (RedisError, OSError, KombuError) as exc:
            self.trip(type(exc).__name__)
            return None

    def reset(self) -> None:
        """Forget the client and close the breaker (after a fork, or a re-bind)."""
        self._client, self._pid, self._open_until = None, os.getpid(), 0.0


__all__ = ["FastPath"]
