"""Global token buckets, one per rate-limited queue (``CONVEYOR_RATE_LIMITS``), in Redis.

A bucket's level may go below zero: a job that finds no token *reserves* the next free
token time (its own, kept by job id beside the bucket), so a burst of k jobs over the limit
is spread over k/rate seconds instead of coming back at once. Whoever asks first for a job
takes its token or reservation: the publisher of a fresh job (which then holds a job due
later back until its time, so it is delivered once), or the worker's admission at claim
(:mod:`conveyor.worker.admission`), which runs a job on its due reservation without taking
a second token. Reservations whose job never comes back are dropped after a grace period;
a Redis wipe only loses them (a returning job then takes a token like any other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.commands.core import Script

from conveyor.settings import RateLimit

# A token bucket per queue whose level may go below zero: each refused job reserves the
# next token time (KEYS[2], scores in ms). Returns the seconds to wait (0: admitted, on a
# fresh token or on the job's due reservation). ARGV[5] = 1 (a publisher): a token taken
# now is kept as a reservation due now, which the job's claim then uses.
TAKE_TOKEN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local rate, burst, job, grace_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%.3f', now_ms - grace_ms))
local due = tonumber(redis.call('ZSCORE', KEYS[2], job))
if due then
  if due <= now_ms then
    redis.call('ZREM', KEYS[2], job)
    return '0'
  end
  return tostring((due - now_ms) / 1000)
end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(b[1]) or burst, tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens < 1 then wait = (1 - tokens) / rate end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
if wait == 0 and ARGV[5] ~= '1' then return '0' end
due = math.ceil(now_ms + wait * 1000)
redis.call('ZADD', KEYS[2], string.format('%d', due), job)
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[2], math.ceil(tonumber(last[2]) - now_ms + grace_ms))
if wait == 0 then return '0' end
return tostring((due - now_ms) / 1000)
"""

# Reservations whose job has not come back this long after their due time (cancelled,
# finished elsewhere, parked for longer) are dropped; the token they took is not returned.
RESERVATION_GRACE_MS = 300_000


class TokenBuckets:
    """The queues' buckets, on the Redis ``redis()`` returns."""

    def __init__(self, redis: Callable[[], Redis], *, key_prefix: str) -> None:
        self._redis = redis
        self.key_prefix = key_prefix
        self._script: Script | None = None

    def take(self, queue: str, rate: RateLimit, job_id: str, *, hold: bool = False) -> float:
        """Seconds job ``job_id`` must wait for its token on ``queue`` (0: it may run now,
        on a fresh token or its due reservation). ``hold``: a token taken now is kept as a
        reservation due now, for the job's claim to use (a publisher's call)."""
        r = self._redis()
        if self._script is None:
            self._script = r.register_script(TAKE_TOKEN)
        burst = rate.burst or max(1.0, rate.rate)
        bucket = f"{self.key_prefix}rate:{queue}"
        args: list[Any] = [rate.rate, burst, job_id, RESERVATION_GRACE_MS, 1 if hold else 0]
        return float(self._script(keys=[bucket, f"{bucket}:held"], args=args, client=r))


__all__ = ["RESERVATION_GRACE_MS", "TAKE_TOKEN", "TokenBuckets"]
