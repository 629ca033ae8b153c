"""Wake-ups of a job's waiters: one PUBLISH per terminal job, sent without awaiting a reply.

The wake-up is a hint, not a record: Postgres already holds the outcome, and a waiter
(:meth:`conveyor.client.handle.JobHandle.wait`) re-reads it at least every few seconds. So the
worker need not pay a round trip per job for it: each thread sends on its own connection
in ``CLIENT REPLY OFF`` mode, where Redis sends nothing back. A send that fails reconnects
and sends once more; a wake-up lost with a dying connection costs a waiter its next
re-read, never the job.

The outbox has a wake-up of its own: after a transaction that wrote events commits, an
:class:`Announcer` sends one ``PUBLISH`` on :func:`events_channel` (best effort: a short
timeout, then silence for a while); in a process that streams events, one
:class:`Subscriber` thread listens and wakes every stream at once (they also poll, so a
lost wake-up costs a poll interval).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

log = logging.getLogger("conveyor.wakeups")


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


def events_channel(key_prefix: str) -> str:
    """The channel announcing that the outbox has new committed events."""
    return f"{key_prefix}events"


class Announcer:
    """``announcer()`` sends one ``PUBLISH channel ""`` through :class:`Wakeups`, never raising.

    A commit calls it (:func:`conveyor.store.events.announce_commits`), so it must not make
    one wait: Redis gets ``timeout`` seconds to accept a connection or a send, and after a
    failure the next ``cooldown`` seconds send nothing (logged at debug: the streams poll).
    """

    def __init__(
        self, url: Callable[[], str | None], channel: str, *, timeout: float = 0.2, cooldown: float = 5.0
    ) -> None:
        self._url = url
        self.channel = channel
        self.timeout = timeout
        self.cooldown = cooldown
        self._wakeups: Wakeups | None = None
        self._pid = os.getpid()
        self._quiet_until = 0.0
        # Reentrant: a commit's hook may run inside this very call (a pool checkin by GC).
        self._lock = threading.RLock()

    def __call__(self) -> None:
        """Announce new events now (or not at all)."""
        if time.monotonic() < self._quiet_until:
            return
        try:
            wakeups = self._client()
            if wakeups is not None:
                wakeups.publish(self.channel, "")
        except (RedisError, OSError) as exc:
            self._quiet_until = time.monotonic() + self.cooldown
            log.debug("outbox wake-up not sent (%s): none for %gs", type(exc).__name__, self.cooldown)

    def _client(self) -> Wakeups | None:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are not ours
            self._wakeups, self._pid, self._quiet_until = None, os.getpid(), 0.0
        if self._wakeups is None:
            url = self._url()
            if not url:
                return None
            with self._lock:
                if self._wakeups is None:
                    redis = Redis.from_url(
                        url,
                        socket_timeout=self.timeout,
                        socket_connect_timeout=self.timeout,
                        retry=Retry(NoBackoff(), 0),
                    )
                    self._wakeups = Wakeups(redis)
        return self._wakeups


Listener = Callable[[], None]


class Subscriber:
    """One thread that listens on ``channel`` and calls every listener per wake-up.

    Messages that arrived together wake once. After Redis failed (or at the first
    connection), listeners are called once when it answers again: wake-ups sent meanwhile
    are lost. The thread runs while there are listeners and ends a second after the last
    one left.
    """

    def __init__(self, url: str, channel: str, *, retry: float = 1.0) -> None:
        self.url = url
        self.channel = channel
        self.retry = retry
        self._listeners: list[Listener] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.subscribed = threading.Event()  # set while subscribed (tests wait for it)

    def add(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener()`` (from this subscriber's thread) at each wake-up, until the
        returned function is called. ``listener`` must be quick and must not raise."""
        with self._lock:
            self._listeners.append(listener)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="conveyor-event-wakes", daemon=True)
                self._thread.start()

        def remove() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return remove

    def _wake_all(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # one stream's trouble is not the others'
                log.debug("an event wake-up listener failed", exc_info=True)

    def _run(self) -> None:
        pubsub: Any = None
        try:
            while True:
                with self._lock:
                    if not self._listeners:
                        self._thread = None
                        self.subscribed.clear()
                        return
                try:
                    if pubsub is None:
                        pubsub = self._subscribe()
                        self._wake_all()  # what was announced before (or while Redis was away)
                    if pubsub.get_message(timeout=1.0) is not None:
                        while pubsub.get_message(timeout=0) is not None:
                            pass
                        self._wake_all()
                except Exception as exc:  # Redis away (or its client confused): poll, retry
                    log.debug("event wake-ups unavailable (%s): streams poll", type(exc).__name__)
                    self.subscribed.clear()
                    _close(pubsub)
                    pubsub = None
                    time.sleep(self.retry)
        finally:
            _close(pubsub)

    def _subscribe(self) -> Any:
        redis = Redis.from_url(
            self.url, socket_connect_timeout=2.0, socket_timeout=10.0, health_check_interval=5
        )
        pubsub = redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(self.channel)
            pubsub.get_message(timeout=1.0)  # the confirmation: subscribed from here on
        except BaseException:
            _close(pubsub)
            raise
        self.subscribed.set()
        return pubsub


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(Exception):  # already gone
            pubsub.close()
            pubsub.connection_pool.disconnect()


_subscribers: dict[tuple[str, str], Subscriber] = {}
_subscribers_pid = os.getpid()
_subscribers_lock = threading.Lock()


def subscriber(url: str, channel: str) -> Subscriber:
    """This process's one :class:`Subscriber` of ``channel`` on the Redis at ``url``."""
    global _subscribers_pid
    with _subscribers_lock:
        if _subscribers_pid != os.getpid():  # a forked child has no threads: start afresh
            _subscribers.clear()
            _subscribers_pid = os.getpid()
        found = _subscribers.get((url, channel))
        if found is None:
            found = _subscribers[(url, channel)] = Subscriber(url, channel)
        return found


__all__ = ["Announcer", "Subscriber", "Wakeups", "events_channel", "subscriber"]
