"""kombu's Redis transport, reusing one client object per channel.

kombu builds a new ``redis.Redis`` object for every command it sends outside the
consumer's poll (each publish, each delivery's unacked bookkeeping, each ack), and
redis-py's constructor is not cheap: about a tenth of a worker consumer's CPU per job
(issue #16's profile). The object only wraps the channel's connection pool, which hands out
a connection per command, so one object per channel and pool behaves the same.
``celery_config`` selects this transport for ``redis://`` broker URLs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

NAME = "conveyor.transport:Transport"


class Channel(kombu_redis.Channel):
    """A kombu Redis channel whose synchronous client is built once per pool."""

    _sync_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """``client`` if given, else this channel's client over its pool."""
        if client:
            yield client
            return
        cached = self._sync_client
        if cached is None or cached.connection_pool is not self.pool:
            cached = self._sync_client = self._create_client()  # type: ignore[no-untyped-call]
        yield cached


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


__all__ = ["NAME", "Channel", "Transport"]
