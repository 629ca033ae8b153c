"""Global rate limits and concurrency caps, checked at claim against real Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest

from conveyor.store.db import schema as s
from conveyor.worker.admission import Admission, RateLimit
from tests.helpers import job_row

pytestmark = pytest.mark.timeout(120)


def test_throttled_jobs_are_visible_and_still_finish(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(platform.settings.rate_limits, "demo", RateLimit(rate=4, burst=1))
    platform.redis.delete(f"{platform.settings.key_prefix}rate:demo")
    handles = [platform.submit("conveyor.demo.square", {"n": i}) for i in range(8)]
    assert [h.wait(60) for h in handles] == [s.SUCCEEDED] * 8
    rows = [job_row(platform, h.id) for h in handles]
    starts = sorted(r["started_at"] for r in rows)
    # 8 starts at 4 per second with a bucket of 1: at least 7 / 4 s from first to last.
    assert (starts[-1] - starts[0]).total_seconds() >= 1.5
    limited = [h for h in handles if "job.rate_limited" in [e.topic for e in h.events()[0]]]
    assert limited, "no job was parked by the rate limit"
    event = next(e for e in limited[0].events()[0] if e.topic == "job.rate_limited")
    assert event.body["queue"] == "demo" and event.body["reason"] == "rate" and event.body["wait"] > 0
    # A parked job never counted an attempt.
    assert all(r["attempts"] == 1 for r in rows)


def test_concurrency_cap_holds_across_callers_and_expires_with_a_dead_holder(platform: Any, tag: str) -> None:
    admission = Admission(lambda: platform.redis, key_prefix=f"{tag}:", slot_ttl=1.0, busy_wait=0.25)
    take = lambda job: admission.check(  # noqa: E731
        queue="q", rate=None, stage="conveyor.x.y", concurrency=2, job_id=job
    )
    a, b = take("a"), take("b")
    assert a.slot is not None and b.slot is not None
    refused = take("c")
    assert refused.reason == "concurrency" and refused.wait == 0.25 and refused.slot is None
    assert take("a").slot is not None  # a redelivery of a holder keeps its slot
    admission.release(a.slot)
    assert take("c").slot is not None
    # "b" and "c" stop renewing (their worker died): their slots come back after the TTL.
    time.sleep(1.2)
    assert take("d").slot is not None and take("e").slot is not None
