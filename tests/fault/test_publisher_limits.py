"""The publisher family's limits with real prefork workers, read from the Graph peer's
request log: at most ``channel_concurrency`` posts of a channel in flight however many
workers and slots there are, other channels unhindered; one post per account at a time;
a parked post moved by ``Platform.reschedule`` stays put when a slot frees."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest

from conveyor.store.db import schema as s
from pipelines.publisher import schedule_post
from pipelines.publisher.peers import GraphPeer
from tasks.publisher import tables as t
from tests.fault.conftest import Spawn
from tests.fault.publisher_support import creating, of_account, publishing
from tests.helpers import eventually, job_row
from tests.integration.publisher_support import events, now, plan, post_row

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]


def _completed(platform: Any, post_ids: list[str], timeout: float) -> None:
    eventually(lambda: all(post_row(platform, p)["status"] == t.COMPLETED for p in post_ids), timeout)


def test_a_channel_never_runs_more_than_its_limit_and_others_are_unhindered(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    with GraphPeer(latency_s=0.3) as peer, publishing(platform, peer) as env:
        for _ in range(3):
            spawn(concurrency=2, env=env)
        # One account each: only the channel's limit (2) binds, never an account's lease.
        posts = [schedule_post(platform, plan(f"{tag}-{i}")) for i in range(20)]
        eventually(lambda: any(r.channel == "facebook" for r in peer.requests), timeout=30)
        asked = time.monotonic()  # the peer's clock
        other = schedule_post(platform, plan(f"{tag}-ig", "instagram"))
        _completed(platform, [p.id for p in posts], timeout=60)
        assert platform.job(other.job_id).wait(30) == s.SUCCEEDED
        facebook = [r for r in peer.requests if r.channel == "facebook"]
        instagram = [r for r in peer.requests if r.channel == "instagram"]
        assert peer.max_overlap(lambda r: r.channel == "facebook") == 2
        # The other channel started while the first one's backlog was still waiting.
        first_ig = min(r.started for r in instagram)
        last_fb = max(r.started for r in facebook)
        print(f"instagram_start_s={first_ig - asked:.2f} facebook_last_start_s={last_fb - asked:.2f}")
        assert first_ig < last_fb
        for i in range(20):
            assert len(peer.posts(f"acct-{tag}-{i}")) == 1
        assert len(peer.media(f"acct-{tag}-ig")) == 1


def test_one_post_at_a_time_per_account_with_slots_to_spare(platform: Any, spawn: Spawn, tag: str) -> None:
    account = f"acct-{tag}"
    limits = {"channel_concurrency": {"facebook": 4}}  # only the account's lease binds
    with GraphPeer(latency_s=0.2) as peer, publishing(platform, peer, **limits) as env:
        spawn(concurrency=4, env=env)
        posts = [schedule_post(platform, plan(tag, caption=f"Post {i} from {tag}")) for i in range(8)]
        _completed(platform, [p.id for p in posts], timeout=60)
        assert peer.max_overlap(lambda r: r.target == account) == 1
        assert len(peer.posts(account)) == 8
        assert len([r for r in of_account(peer, account) if creating(r)]) == 8


def test_a_parked_post_rescheduled_stays_put_when_a_slot_frees(platform: Any, spawn: Spawn, tag: str) -> None:
    limits = {"channel_concurrency": {"facebook": 1}}
    with GraphPeer(latency_s=2.0) as peer, publishing(platform, peer, **limits) as env:
        spawn(concurrency=2, env=env)
        a = schedule_post(platform, plan(f"{tag}-a"))
        eventually(lambda: of_account(peer, f"acct-{tag}-a"), timeout=30)
        b = schedule_post(platform, plan(f"{tag}-b"))
        b_job = b.job_id
        assert a.job_id is not None and b_job is not None
        eventually(lambda: job_row(platform, b_job)["status"] == s.THROTTLED, timeout=10)
        [parked] = events(platform, b_job, "job.rate_limited")
        assert parked["reason"] == "concurrency" and parked["key"] == "channel:facebook"
        later = now() + dt.timedelta(hours=1)
        assert platform.reschedule(b_job, later)
        moved = job_row(platform, b_job)
        assert moved["status"] == s.QUEUED
        assert abs((moved["run_at"] - later).total_seconds()) < 1

        assert platform.job(a.job_id).wait(30) == s.SUCCEEDED
        time.sleep(2)  # A's slot is free: a lost reschedule would have woken B by now
        assert job_row(platform, b_job)["status"] == s.QUEUED
        assert not events(platform, b_job, "job.unparked")
        assert not of_account(peer, f"acct-{tag}-b")
        assert post_row(platform, b.id)["status"] == t.PENDING

        assert platform.reschedule(b_job, now())
        assert platform.job(b_job).wait(30) == s.SUCCEEDED
    assert len(peer.posts(f"acct-{tag}-b")) == 1
    assert post_row(platform, b.id)["status"] == t.COMPLETED
