"""Dedup keys: the submit-time decision of a :mod:`conveyor.dedup` policy.

Postgres is the authority: a ``dedup_keys`` row, written in the submit transaction with
``INSERT … ON CONFLICT … DO UPDATE … WHERE`` the old holder no longer holds. Because the
conflicting insert waits for the holder's transaction, a job can never be deduplicated
into one that did not commit. Redis only caches *committed* holders (always with a TTL),
so a duplicate is usually answered by one script call and costs no Postgres commit; a
cache miss always asks Postgres.

Times here come from the dedup clock: Redis ``TIME`` in production, a virtual clock in
tests, so windows can be tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis import Redis
from sqlalchemy import Connection, and_, exists, literal_column, or_, select, update

from conveyor.dedup import PLAN_OPTION, Dedup, Mode, Reuse, canonical_json
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now_plus, next_seq, upsert
from conveyor.store.db.namespace import physical_name
from conveyor.store.db.schema import dedup_keys, jobs

if TYPE_CHECKING:
    from conveyor.settings import ConveyorSettings

FAILED = (s.DEAD, s.CANCELLED, s.EXPIRED)


@dataclass
class Acquired:
    """The outcome of :meth:`Deduplicator.acquire`."""

    holder: str
    won: bool
    replaced: bool = False  # debounce: the holder's payload was replaced


# Returns {holder or '', now in microseconds}. With no clock given it reads Redis TIME
# itself, so a duplicate costs one round trip, clock included.
_CACHE_HIT = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local out = {'', string.format('%.0f', now)}
local v = redis.call('GET', KEYS[1])
if not v then return out end
local sep = string.find(v, '|', 1, true)
if not sep then return out end
local job = string.sub(v, 1, sep - 1)
local exp = tonumber(string.sub(v, sep + 1))
if exp > 0 and exp * 1000 <= now then return out end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', '100000', '*', 'job', job, 'dedup', ARGV[2], 'stage', ARGV[3])
out[1] = job
return out
"""

_RELEASE = """
local k = redis.call('GET', KEYS[1])
if k then
  local v = redis.call('GET', k)
  if v and string.sub(v, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. '|' then
    redis.call('DEL', k)
  end
  redis.call('DEL', KEYS[1])
end
return 1
"""


class Deduplicator:
    """The dedup authority (Postgres) and its Redis fast path."""

    def __init__(self, settings: ConveyorSettings, redis: Callable[[], Redis]) -> None:
        self.settings = settings
        self._redis = redis
        self.clock: Callable[[], float] = self.redis_time
        self.stream = f"{settings.key_prefix}dedup-events"
        self._hit: Any = None
        self._release: Any = None

    def redis_time(self, client: Redis | None = None) -> float:
        """Redis ``TIME``: one clock for every submitter, whatever their hosts say."""
        sec, usec = (client or self._redis()).time()
        return float(sec) + usec / 1e6

    def _key(self, scope: str, key: str) -> str:
        return f"{self.settings.key_prefix}dd:{scope}:{key}"

    def _of(self, job_id: str) -> str:
        return f"{self.settings.key_prefix}dd-of:{job_id}"

    # -- fast path ----------------------------------------------------------------------

    def cached(
        self, scope: str, key: str, stage: str, client: Redis | None = None
    ) -> tuple[str | None, float]:
        """One script call: a committed, unexpired holder (and its event) or None, and the
        dedup clock's reading (taken inside the script when the clock is Redis TIME)."""
        if self._hit is None:
            self._hit = self._redis().register_script(_CACHE_HIT)
        given = "" if self.clock == self.redis_time else str(int(self.clock() * 1_000_000))
        job, now = self._hit(
            keys=[self._key(scope, key), self.stream], args=[given, f"{scope}:{key}", stage], client=client
        )
        holder = job.decode() if isinstance(job, bytes) else str(job)
        return (holder or None), int(now) / 1_000_000

    def cache(
        self,
        scope: str,
        key: str,
        job_id: str,
        mode: Mode,
        expires_ms: int | None,
        now: float,
        client: Redis | None = None,
    ) -> None:
        """Remember a committed holder (never an uncommitted one), always with a TTL."""
        ttl = self.settings.dedup_cache_ttl
        if expires_ms:
            ttl = min(ttl, max(0.001, expires_ms / 1000 - now))
        ms = max(1, int(ttl * 1000))
        pipe = (client or self._redis()).pipeline(transaction=False)
        pipe.set(self._key(scope, key), f"{job_id}|{expires_ms or 0}", px=ms)
        if mode == "simple":
            pipe.set(self._of(job_id), self._key(scope, key), px=ms)
        pipe.execute()

    def forget(self, dedup_id: str) -> None:
        """Drop the cached holder of ``dedup_id`` (after Postgres gave the id to another job)."""
        scope, _, key = dedup_id.partition(":")
        self._redis().delete(self._key(scope, key))

    def release(self, job_id: str) -> None:
        """Compare-and-delete the cached holder once ``job_id`` is terminal (simple mode)."""
        if self._release is None:
            self._release = self._redis().register_script(_RELEASE)
        self._release(keys=[self._of(job_id)], args=[job_id])

    # -- authority ----------------------------------------------------------------------

    def acquire(
        self,
        conn: Connection,
        *,
        scope: str,
        key: str,
        mode: Mode,
        job_id: str,
        now: float,
        ttl: float | None,
        reuse: Reuse = "never",
    ) -> Acquired:
        """Take (scope, key) for ``job_id`` unless a valid holder has it; in ``conn``'s transaction."""
        now_ms = int(now * 1000)
        expires_ms = int((now + ttl) * 1000) if ttl else None
        holder = jobs.alias("holder")
        # The conflicting row itself, by the table's name as it exists (SQLite: prefixed).
        conflicting: Any = literal_column(f"{physical_name(conn, dedup_keys)[1]}.job_id")

        def holder_is(*cond: Any) -> Any:
            # Must refer to the conflicting row itself. SQLAlchemy cannot correlate into an
            # ON CONFLICT clause and would add dedup_keys to the subquery's FROM (a cross
            # join: any started job anywhere would free every key), hence the literal.
            q = select(holder.c.id).where(holder.c.id == conflicting, *cond)
            return exists(q)

        # No "holder row missing" test here: a holder that committed while this statement
        # waited on the conflicting row is invisible to its snapshot, so "missing" would
        # free a live key. Keys of purged jobs are deleted by the reconciler instead.
        finished = holder_is(holder.c.status.in_(list(s.TERMINAL)))
        failed = holder_is(holder.c.status.in_(list(FAILED)))
        started = holder_is(or_(holder.c.status != s.QUEUED, holder.c.published_at.is_not(None)))
        expired = and_(dedup_keys.c.expires_ms.is_not(None), dedup_keys.c.expires_ms <= now_ms)
        free_if = or_(
            and_(dedup_keys.c.mode == "simple", finished),
            and_(dedup_keys.c.mode.in_(["throttle", "id"]), expired),
            and_(dedup_keys.c.mode == "debounce", or_(expired, started)),
        )
        if reuse == "always":
            free_if = or_(free_if, True)  # type: ignore[arg-type]
        elif reuse == "if_failed":
            free_if = or_(free_if, failed)
        values = {
            "scope": scope,
            "key": key,
            "job_id": job_id,
            "mode": mode,
            "expires_ms": expires_ms,
            "first_ms": now_ms,
            "updated_ms": now_ms,
        }
        base = upsert(conn, dedup_keys).values(**values)
        stmt = base.on_conflict_do_update(
            index_elements=["scope", "key"],
            set_={k: base.excluded[k] for k in ("job_id", "mode", "expires_ms", "first_ms", "updated_ms")},
            where=free_if,
        ).returning(dedup_keys.c.job_id)
        won = conn.execute(stmt).scalar_one_or_none() == job_id
        if won:
            return Acquired(job_id, True)
        current = (
            conn.execute(select(dedup_keys).where(dedup_keys.c.scope == scope, dedup_keys.c.key == key))
            .mappings()
            .one()
        )
        return Acquired(str(current["job_id"]), False)

    def retake(self, conn: Connection, dedup_id: str, job_id: str, *, now: float, mode: Mode) -> str | None:
        """Give ``dedup_id`` back to ``job_id`` (a follower whose holder was cancelled),
        unless another *live* job holds it: that job's id is returned.

        The row is locked, so a concurrent submit's acquire waits and then sees the new
        holder. A throttle or id key keeps its length of hold; ``mode`` applies only when
        no row exists (nobody held the id since it was purged).
        """
        scope, _, key = dedup_id.partition(":")
        row = (
            conn.execute(
                select(dedup_keys)
                .where(dedup_keys.c.scope == scope, dedup_keys.c.key == key)
                .with_for_update()
            )
            .mappings()
            .one_or_none()
        )
        now_ms = int(now * 1000)
        if row is None:
            values: dict[str, Any] = {"scope": scope, "key": key, "job_id": job_id, "mode": mode}
            values.update(expires_ms=None, first_ms=now_ms, updated_ms=now_ms)
            conn.execute(upsert(conn, dedup_keys).values(**values).on_conflict_do_nothing())
            return None
        holder = str(row["job_id"])
        if holder == job_id:
            return None
        status = conn.execute(select(jobs.c.status).where(jobs.c.id == holder)).scalar_one_or_none()
        if status is not None and status not in s.TERMINAL:
            return holder
        held = (row["expires_ms"] - row["first_ms"]) / 1000 if row["expires_ms"] is not None else None
        self.steal(conn, scope=scope, key=key, old=holder, new=job_id, mode=row["mode"], now=now, ttl=held)
        return None

    def debounce(
        self,
        conn: Connection,
        *,
        scope: str,
        key: str,
        holder: str,
        payload: Mapping[str, Any],
        seq: int,
        now: float,
        window: float,
        max_wait: float | None,
    ) -> bool:
        """Replace the pending holder's payload (if ``seq`` is newer) and push its start back.

        False when the holder already left ``queued``/unpublished: its window is over.
        """
        row = (
            conn.execute(select(dedup_keys).where(dedup_keys.c.scope == scope, dedup_keys.c.key == key))
            .mappings()
            .one()
        )
        target = now + window
        if max_wait is not None:
            target = min(target, row["first_ms"] / 1000 + max_wait)
        delay = max(0.0, target - now)
        pending = and_(jobs.c.id == holder, jobs.c.status == s.QUEUED, jobs.c.published_at.is_(None))
        res = conn.execute(
            update(jobs)
            .where(pending, or_(jobs.c.dedup_seq.is_(None), jobs.c.dedup_seq < seq))
            .values(payload=dict(payload), dedup_seq=seq, run_at=db_now_plus(delay))
        )
        if res.rowcount == 0:
            # Either no longer pending, or a newer submit already replaced the payload.
            still = conn.execute(select(jobs.c.id).where(pending)).first()
            if still is None:
                return False
            conn.execute(update(jobs).where(pending).values(run_at=db_now_plus(delay)))
        conn.execute(
            update(dedup_keys)
            .where(dedup_keys.c.scope == scope, dedup_keys.c.key == key, dedup_keys.c.job_id == holder)
            .values(expires_ms=int(target * 1000), updated_ms=int(now * 1000))
        )
        return True

    def steal(
        self,
        conn: Connection,
        *,
        scope: str,
        key: str,
        old: str,
        new: str,
        mode: Mode,
        now: float,
        ttl: float | None,
    ) -> bool:
        """Move the key from a holder whose window closed to ``new``."""
        now_ms = int(now * 1000)
        res = conn.execute(
            update(dedup_keys)
            .where(dedup_keys.c.scope == scope, dedup_keys.c.key == key, dedup_keys.c.job_id == old)
            .values(
                job_id=new,
                mode=mode,
                first_ms=now_ms,
                updated_ms=now_ms,
                expires_ms=int((now + ttl) * 1000) if ttl else None,
            )
        )
        return res.rowcount == 1

    @staticmethod
    def sequence(conn: Connection) -> int:
        """The submit's sequence number, assigned by the database."""
        return next_seq(conn)


__all__ = ["PLAN_OPTION", "Acquired", "Dedup", "Deduplicator", "canonical_json"]
