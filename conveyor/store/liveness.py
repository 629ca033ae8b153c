"""Who is alive: the database's own reachability, workers, and messages they took.

*A dead owner or an unreachable database?* A lease is renewed in the database; while the
database cannot be reached no lease can be renewed, so every lease looks stale the
moment it comes back. The relay notes each pass it makes in the database; a gap longer
than a few relay intervals (an outage of Postgres or Redis, or no relay running at all)
restarts the *resumed* clock, and no lease is taken over until a whole lease timeout has
passed since then: long enough for every live holder to renew.

*A message taken by a worker that died before claiming it* sits in the broker's unacked
set for the visibility timeout, or is gone altogether (a SIGKILLed process's socket stays
open for a moment, and Redis answers its pending BRPOP with the next message pushed),
while its job still looks queued. Each worker records every delivery (job id, time) in
Redis before the claim, and refreshes a liveness key with the time of its last beat (on
Redis's clock: the worker's own may be off); the reconciler republishes at once, for a
worker whose key expired, its still-unclaimed deliveries and the still-unclaimed jobs
published while it was dying, instead of waiting for ``republish_after`` (which cannot
tell a lost message from a long queue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis
from sqlalchemy import ColumnElement, Connection, exists, or_, select, true

from conveyor.store.db.dialect import db_now_ms, upsert
from conveyor.store.db.schema import counters

log = logging.getLogger("conveyor.liveness")

TICK = "relay_tick_ms"
RESUMED = "relay_resumed_ms"


def note_tick(conn: Connection, *, gap: float) -> None:
    """Record a relay pass; restart the resumed clock after a gap of ``gap`` seconds."""
    now = conn.execute(select(db_now_ms())).scalar_one()
    last = conn.execute(select(counters.c.value).where(counters.c.name == TICK)).scalar_one_or_none()
    _put(conn, TICK, now)
    if last is None or now - int(last) > gap * 1000:
        _put(conn, RESUMED, now)


def _put(conn: Connection, name: str, value: int) -> None:
    stmt = upsert(conn, counters).values(name=name, value=value)
    conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={"value": value}))


def takeovers_allowed(lease_timeout: float) -> ColumnElement[bool]:
    """SQL: true unless the relay resumed less than a lease timeout ago, or has not passed
    for a lease timeout (the database, or SQLite's single writer, was unavailable: stale
    heartbeats say nothing about their owners yet; a claim must not act on them before
    the relay has noted the gap). No relay ever ran: true, there is nothing to go by."""
    if lease_timeout <= 0:
        return true()
    horizon = db_now_ms() - int(lease_timeout * 1000)
    recent = exists(select(counters.c.name).where(counters.c.name == RESUMED, counters.c.value > horizon))
    stalled = exists(select(counters.c.name).where(counters.c.name == TICK, counters.c.value < horizon))
    return ~or_(recent, stalled)


@dataclass(frozen=True)
class Orphan:
    """A worker found dead: when it last beat, and the jobs delivered to it since."""

    last_beat: float
    delivered: list[str]


# KEYS: alive key, workers hash, deliveries; ARGV: TTL in ms, worker, trim deliveries before.
_BEAT = """
local t = redis.call('TIME')
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[3])
return 1
"""


class Deliveries:
    """Per-worker delivery records and liveness keys in Redis."""

    def __init__(self, redis: Callable[[], Redis], *, key_prefix: str, alive_ttl: float) -> None:
        self._redis = redis
        self.prefix = key_prefix
        self.alive_ttl = alive_ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat: Any = None

    @property
    def beat_interval(self) -> float:
        """How often a live worker refreshes its key."""
        return self.alive_ttl / 4

    def _workers(self) -> str:
        return f"{self.prefix}workers"

    def _alive(self, worker: str) -> str:
        return f"{self.prefix}alive:{worker}"

    def _taken(self, worker: str) -> str:
        return f"{self.prefix}delivered:{worker}"

    def taken_key(self, worker: str) -> str:
        """The sorted set of jobs delivered to ``worker`` (job id → time), which
        :meth:`record` writes; ``conveyor.delivery.transport`` writes it with kombu's bookkeeping."""
        return self._taken(worker)

    def record(self, worker: str, job_id: str) -> None:
        """A message of ``job_id`` reached ``worker`` (before its claim)."""
        self._redis().zadd(self._taken(worker), {job_id: time.time()})

    def beat(self, worker: str) -> None:
        """Refresh the liveness key; forget deliveries old enough to have been claimed.

        The beat's time is Redis ``TIME``, not this host's clock: the relay compares it
        with publish times on the database's clock, whatever the dead worker's clock said.
        Deliveries are trimmed on this process's clock, which also wrote their scores."""
        if self._beat is None:
            self._beat = self._redis().register_script(_BEAT)
        keys = [self._alive(worker), self._workers(), self._taken(worker)]
        trim_before = time.time() - 6 * self.alive_ttl
        r = self._redis()
        self._beat(keys=keys, args=[int(self.alive_ttl * 1000), worker, repr(trim_before)], client=r)

    def start(self, worker: str) -> None:
        """Beat every quarter of the TTL in a daemon thread until :meth:`stop`."""
        self._stop.clear()

        def loop() -> None:
            while True:
                try:
                    self.beat(worker)
                except Exception:  # Redis down: the key expires, the reconciler decides
                    log.debug("liveness beat failed", exc_info=True)
                if self._stop.wait(self.beat_interval):
                    return

        self._thread = threading.Thread(target=loop, name="conveyor-liveness", daemon=True)
        self._thread.start()

    def stop(self, worker: str) -> None:
        """A clean exit: stop beating and forget this worker (Celery restores its messages)."""
        self._stop.set()
        try:
            r = self._redis()
            r.delete(self._alive(worker), self._taken(worker))
            r.hdel(self._workers(), worker)
        except Exception:
            log.debug("could not deregister worker %s", worker, exc_info=True)

    def orphans(self) -> dict[str, Orphan]:
        """Workers that are no longer alive: their last beat and recent deliveries."""
        r = self._redis()
        out: dict[str, Orphan] = {}
        for raw, beat in (r.hgetall(self._workers()) or {}).items():
            worker = _text(raw)
            if r.exists(self._alive(worker)):
                continue
            delivered = [_text(j) for j in r.zrange(self._taken(worker), 0, -1)]
            out[worker] = Orphan(last_beat=float(_text(beat)), delivered=delivered)
        return out

    def forget(self, worker: str) -> None:
        """Drop a dead worker's records (after its deliveries were republished)."""
        r = self._redis()
        r.delete(self._taken(worker))
        r.hdel(self._workers(), worker)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["Deliveries", "Orphan", "note_tick", "takeovers_allowed"]
