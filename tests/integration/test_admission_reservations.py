"""Rate-limit reservations: each refused job gets its own token time (real Redis)."""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest

from conveyor.worker.admission import Admission, RateLimit, Verdict
from tests.helpers import job_row

N_BURST = 40  # at 10/s: 4 s of held-back jobs

pytestmark = pytest.mark.timeout(60)

RATE = RateLimit(rate=10, burst=1)
STEP = 1 / RATE.rate
TOLERANCE = 0.03  # seconds of clock and round-trip slack


def _admission(platform: Any, tag: str) -> Admission:
    return Admission(lambda: platform.redis, key_prefix=f"{tag}:", slot_ttl=5.0, busy_wait=0.25)


def _taker(admission: Admission, *, concurrency: int | None = None) -> Callable[[str], Verdict]:
    def take(job: str) -> Verdict:
        return admission.check(
            queue="q", rate=RATE, stage="conveyor.x.y", concurrency=concurrency, job_id=job
        )

    return take


def _held(platform: Any, tag: str) -> dict[str, float]:
    """The queue's reservations: job id -> due time (ms, Redis clock)."""
    rows = platform.redis.zrange(f"{tag}:rate:q:held", 0, -1, withscores=True)
    return {(m.decode() if isinstance(m, bytes) else m): float(score) for m, score in rows}


def test_a_burst_gets_distinct_token_times_spaced_by_the_rate(platform: Any, tag: str) -> None:
    take = _taker(_admission(platform, tag))
    verdicts = [take(f"j{i}") for i in range(20)]
    assert verdicts[0].reason is None and verdicts[0].wait == 0
    refused = verdicts[1:]
    assert all(v.reason == "rate" for v in refused)
    waits = sorted(v.wait for v in refused)
    assert len(set(waits)) == len(waits)
    gaps = [b - a for a, b in pairwise(waits)]
    assert all(abs(gap - STEP) < TOLERANCE for gap in gaps), gaps
    # The k-th refused job waits about k / rate (its own slot), the last one about 1.9 s.
    assert abs(waits[0] - STEP) < TOLERANCE and abs(waits[-1] - 19 * STEP) < 19 * TOLERANCE
    assert set(_held(platform, tag)) == {f"j{i}" for i in range(1, 20)}
    assert float(platform.redis.hget(f"{tag}:rate:q", "tokens")) < -18  # 19 tokens owed


def test_early_return_waits_the_rest_and_an_on_time_return_takes_no_token(platform: Any, tag: str) -> None:
    take = _taker(_admission(platform, tag))
    assert take("first").reason is None
    a, b = take("a"), take("b")
    assert a.reason == b.reason == "rate"
    held = _held(platform, tag)

    # Back before its time (a redelivery): the rest of its wait, on the same reservation.
    again = take("a")
    assert again.reason == "rate" and 0 < again.wait <= a.wait
    assert _held(platform, tag) == held
    # So the next new job is not pushed back by it: it gets the slot right after "b".
    c = take("c")
    assert abs(c.wait - (b.wait + STEP)) < TOLERANCE
    due_c = _held(platform, tag)["c"]
    assert abs(due_c - held["b"] - STEP * 1000) <= 1

    # Back on time: admitted on its reservation, which is gone, and no token is taken...
    time.sleep(again.wait + 0.01)
    assert take("a") == Verdict()
    assert "a" not in _held(platform, tag)
    # ...so a fresh job still gets the slot right after "c", not one later.
    d = take("d")
    assert d.reason == "rate"
    assert abs(_held(platform, tag)["d"] - due_c - STEP * 1000) <= 1


def test_reservations_left_long_past_due_are_pruned(platform: Any, tag: str) -> None:
    take = _taker(_admission(platform, tag))
    seconds, micros = platform.redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    key = f"{tag}:rate:q:held"
    platform.redis.zadd(key, {"ghost": now_ms - 10 * 60 * 1000, "recent": now_ms - 1000})
    assert take("first").reason is None
    held = _held(platform, tag)
    assert "ghost" not in held and "recent" in held
    # The ghost's job, if it ever shows up, takes a token like any other (here: reserves one).
    late = take("ghost")
    assert late.reason == "rate" and "ghost" in _held(platform, tag)
    # The reservations outlive their furthest due time by the grace period, not forever.
    assert 0 < platform.redis.pttl(key) <= 300_000 + 2_000


def test_a_redis_wipe_loses_reservations_and_returning_jobs_take_tokens(platform: Any, tag: str) -> None:
    take = _taker(_admission(platform, tag))
    assert take("first").reason is None
    assert take("a").reason == "rate"
    platform.redis.delete(f"{tag}:rate:q", f"{tag}:rate:q:held")
    assert take("a") == Verdict()  # a full bucket again
    assert take("b").reason == "rate"
    platform.redis.delete(f"{tag}:rate:q")  # the bucket alone: "b" still runs on its reservation
    time.sleep(STEP + 0.02)
    assert take("b") == Verdict()


def test_a_job_bouncing_off_the_concurrency_cap_keeps_a_single_reservation(platform: Any, tag: str) -> None:
    admission = _admission(platform, tag)
    take = _taker(admission, concurrency=1)
    slots = f"{tag}:slots:conveyor.x.y"
    running = take("running")
    assert running.slot is not None
    # Refused for concurrency: the bucket is not touched.
    assert take("a").reason == "concurrency"
    assert _held(platform, tag) == {}
    admission.release(running.slot)
    # Refused for rate: the slot is given back, a reservation kept.
    a = take("a")
    assert a.reason == "rate" and a.slot is None and platform.redis.zcard(slots) == 0
    due = _held(platform, tag)["a"]
    # At its time the stage is full again: refused for concurrency, the reservation kept...
    other = admission.check(queue="free", rate=None, stage="conveyor.x.y", concurrency=1, job_id="other")
    assert other.slot is not None
    time.sleep(a.wait + 0.01)
    assert take("a").reason == "concurrency"
    assert _held(platform, tag) == {"a": due}
    # ...and used, without a second token, once a slot frees up.
    admission.release(other.slot)
    admitted = take("a")
    assert admitted.reason is None and admitted.slot is not None
    assert _held(platform, tag) == {}


def test_a_burst_over_the_limit_is_held_back_at_publish_and_delivered_once(
    platform: Any, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submitter reserves each job's token time and parks the job until then: the worker
    never receives a job it must park and receive again (deliveries per job: 1)."""
    from conveyor.worker.admission import RateLimit

    monkeypatch.setitem(platform.settings.rate_limits, "demo", RateLimit(rate=10, burst=1))
    platform.redis.delete(
        f"{platform.settings.key_prefix}rate:demo", f"{platform.settings.key_prefix}rate:demo:held"
    )
    handles = [platform.submit("conveyor.demo.square", {"n": i}) for i in range(N_BURST)]
    assert [h.wait(60) for h in handles] == ["succeeded"] * N_BURST
    parked = [[e.body for e in h.events()[0] if e.topic == "job.rate_limited"] for h in handles]
    at_claim = [p for ps in parked for p in ps if p.get("at") != "publish"]
    assert len(at_claim) <= 2, at_claim  # a reservation's edge, at most
    assert sum(1 for ps in parked if ps) >= 15  # held back at publish, each once
    starts = sorted(job_row(platform, h.id)["started_at"] for h in handles)
    assert (starts[-1] - starts[0]).total_seconds() >= 1.5  # 20 at 10/s: the limit held
