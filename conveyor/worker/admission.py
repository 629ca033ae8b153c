"""Admission at claim: global per-queue rate limits and per-stage concurrency caps.

Both live in Redis so that they hold across every worker (Celery's ``rate_limit`` is per
worker process and is not used). A delivery over a limit is not dropped and holds no pool
slot: its job is parked in Postgres as ``throttled`` with ``run_at`` at its token time (or
shortly, for a full stage) and a ``job.rate_limited`` event, and the relay publishes it
again when due.

Over the rate limit a job *reserves* the next free token time: the bucket goes one token
further below zero and the job's due time is kept in a sorted set beside the bucket
(``rate:<queue>:held``, member: the job id), so the k-th job refused in a burst waits about
k/rate instead of every one coming back at once. When the job returns at or after its due
time it runs on its reservation without taking another token; earlier, it is told to wait
the rest. Reservations whose job never returns are pruned after a grace period; a Redis
wipe only loses them (a returning job then takes a token like any other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.commands.core import Script

from conveyor.delivery.ratelimit import TokenBuckets
from conveyor.settings import RateLimit

# A counting semaphore per stage: members expire unless renewed (a killed worker's slot
# comes back after the TTL). Returns 1 if ``member`` took a slot, 2 if it held one already
# (another copy of the job runs with it, or ran until its worker died), 0 if refused.
_TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[2])
if held or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  if held then return 2 end
  return 1
end
return 0
"""


# A job refused a slot is listed (oldest first) for the next release to wake; returns 1 if
# a slot is free by now, so a release that came between the refusal and the listing is not
# missed. The list lives as long as the slots do.
_ADD_WAITER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
redis.call('PEXPIRE', KEYS[2], 86400000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Slot:
    """A held concurrency slot of a stage. ``fresh``: this delivery took it; else the job
    held it already (a copy of it runs, or ran), and only a run of the job gives it back."""

    key: str
    member: str
    fresh: bool = True


@dataclass(frozen=True)
class Verdict:
    """Whether a delivery may run now; if not, how long to park it and why."""

    wait: float = 0.0
    reason: str | None = None  # "rate" or "concurrency"
    slot: Slot | None = None


class Admission:
    """Checks a delivery against its queue's rate limit and its stage's concurrency cap."""

    def __init__(
        self, redis: Callable[[], Redis], *, key_prefix: str, slot_ttl: float, busy_wait: float
    ) -> None:
        self._redis = redis
        self.key_prefix = key_prefix
        self.slot_ttl_ms = max(1000, int(slot_ttl * 1000))
        self.busy_wait = busy_wait
        self._scripts: dict[str, Script] = {}
        self.buckets = TokenBuckets(redis, key_prefix=key_prefix)

    def _run(self, source: str, keys: list[str], *args: float | str) -> Any:
        r = self._redis()
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = r.register_script(source)
        return script(keys=keys, args=list(args), client=r)

    def check(
        self,
        *,
        queue: str,
        rate: RateLimit | None,
        stage: str,
        concurrency: int | None,
        job_id: str,
        key: str = "",
    ) -> Verdict:
        """Take a slot (if capped) and a token or the job's due reservation (if limited).

        ``key`` is the stage's concurrency key (``""``: the stage's one cap). Over the rate
        limit the job keeps a reservation (its own token time, the wait returned) and no
        slot; refused for concurrency, it holds nothing new.
        """
        # The slot comes first so that a job refused for concurrency never touches the bucket
        # (it would otherwise consume a token, or reserve one, per bounce off a full stage). A
        # job refused for rate gives its slot back but keeps its reservation, which it uses
        # whenever it next gets a slot, so bouncing off the cap later costs no second token.
        slot = None
        if concurrency is not None:
            slot = Slot(self.slot_key(stage, key), job_id)
            took = int(self._run(_TAKE_SLOT, [slot.key], concurrency, slot.member, self.slot_ttl_ms))
            if not took:
                return Verdict(wait=self.busy_wait, reason="concurrency")
            slot = Slot(slot.key, slot.member, fresh=took == 1)
        if rate is not None:
            wait = self.buckets.take(queue, rate, job_id)
            if wait > 0:
                if slot is not None and slot.fresh:
                    self.release(slot)
                return Verdict(wait=wait, reason="rate")
        return Verdict(slot=slot)

    def slot_key(self, stage: str, key: str = "") -> str:
        """The Redis key of a stage's slots (of one concurrency key)."""
        return f"{self.key_prefix}slots:{stage}" + (f":{key}" if key else "")

    def add_waiter(self, slot_key: str, job_id: str, limit: int) -> bool:
        """Note ``job_id`` as parked for a slot of ``slot_key``; True when a slot is free by
        now (it freed between the refusal and this call: the caller wakes a waiter)."""
        return bool(int(self._run(_ADD_WAITER, [slot_key, f"{slot_key}:parked"], job_id, limit)))

    def next_waiter(self, slot_key: str) -> str | None:
        """Take the longest-parked job of ``slot_key`` off its list, or None."""
        popped = self._redis().zpopmin(f"{slot_key}:parked", 1)
        if not popped:
            return None
        member = popped[0][0]
        return member.decode() if isinstance(member, bytes) else str(member)

    def renew(self, slot: Slot) -> None:
        """Keep a running job's slot (called by its heartbeat)."""
        r = self._redis()
        r.zadd(slot.key, {slot.member: _redis_ms(r) + self.slot_ttl_ms}, xx=True)

    def release(self, slot: Slot) -> None:
        """Give the slot back."""
        self._redis().zrem(slot.key, slot.member)


def _redis_ms(r: Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


__all__ = ["Admission", "RateLimit", "Slot", "Verdict"]
