"""Wake-ups of a job's waiters: one PUBLISH per terminal job, sent without awaiting a reply.

The wake-up is a hint, not a record: Postgres already holds the outcome, and a waiter
(:meth:`conveyor.client.handle.JobHandle.wait`) re-reads it at least every few seconds. So the
worker need not pay a round trip per job for it: each thread sends on its own connection
in ``CLIENT REPLY OFF`` mode, where Redis sends nothing back. A send that fails reconnects
and sends once more; a wake-up lost with a dying connection costs a waiter its next
re-read, never the job.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from redis import Redis
from redis.exceptions import RedisError


class Wakeups:
    """Fire-and-forget ``PUBLISH`` over a per-thread, reply-less connection of ``redis``'s pool."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._local = threading.local()

    def publish(self, channel: str, message: str) -> None:
        """Send ``PUBLISH channel message``; raises ``RedisError``/``OSError`` if Redis
        cannot be reached even on a fresh connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                conn.send_command("PUBLISH", channel, message)
                return
            except (RedisError, OSError):
                self.close()
        conn = self._connect()
        try:
            conn.send_command("PUBLISH", channel, message)
        except (RedisError, OSError):
            self.close()
            raise

    def close(self) -> None:
        """Drop this thread's connection."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with contextlib.suppress(Exception):  # already gone
                conn.disconnect()

    def _connect(self) -> Any:
        pool = self.redis.connection_pool
        # No health checks: they await a reply this connection never gets.
        kwargs = {**pool.connection_kwargs, "health_check_interval": 0}
        conn = pool.connection_class(**kwargs)
        conn.connect()
        try:
            conn.send_command("CLIENT", "REPLY", "OFF")
        except BaseException:
            conn.disconnect()
            raise
        self._local.conn = conn
        return conn


__all__ = ["Wakeups"]
