"""Hosts whose clocks run 90 s ahead and 90 s behind (``libfaketime``), beyond the lease
and every dedup window: the database's and Redis's clocks decide, so no lease is taken
over early, by their relays or anyone's, and no dedup window ends early."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from typing import Any

import pytest
import redis
from sqlalchemy import select

from conveyor.dedup import Dedup
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dedup_keys
from tests.helpers import effect_count, eventually, job_row
from tests.hosts.host import LEASE, TIMERS, Hosts, clock_offset, needs_unshare, run_in, skewed
from tests.hosts.jobs import running_for, started, story, takeovers

pytestmark = [pytest.mark.timeout(300), pytest.mark.fault, needs_unshare]

SKEW = 90.0
TTL = 30.0  # the throttle window: a third of the skew
RUN = 26.0  # each job's run: past the watch of three leases and the takeover that follows
SUBMIT = """
from config.celery_app import platform
from conveyor.dedup import Dedup
policy = Dedup(mode="throttle", key="{key}", ttl={ttl})
print(platform.submit("conveyor.demo.square", {{"n": 1}}, dedup=policy).id)
"""


def _redis_time(platform: Any) -> float:
    sec, usec = platform.redis.time()
    return float(sec) + usec / 1e6


class RelayClocks:
    """How far off, in skews (-1, 0, 1), the clock of each relay that passes while it
    watches reads: every relay writes its pass note (its clock's time) to one key, read
    here through Redis's MONITOR. A poll of the key sees only its last writer, and relays
    that pass in step hide each other's notes from it."""

    def __init__(self, platform: Any) -> None:
        self.key = f"{platform.settings.key_prefix}relay:pass"
        self.seen: set[int] = set()
        self._monitor = redis.Redis.from_url(platform.settings.redis_url).monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                command = self._monitor.next_command()
                if command["command"].startswith(f"SET {self.key} "):
                    at = re.search(r'"at": ([0-9.e+-]+)', command["command"])
                    if at is not None:
                        self.seen.add(round((float(at[1]) - command["time"]) / SKEW))
        except (redis.ConnectionError, OSError, ValueError):  # closed by close()
            return

    def close(self) -> None:
        """Stop watching."""
        self._monitor.connection.disconnect()
        self._thread.join(timeout=5)


def test_skewed_hosts_take_over_no_live_lease_and_only_stale_ones_after_the_lease(
    platform: Any, hosts: Hosts, tag: str
) -> None:
    ahead, behind = skewed(+SKEW), skewed(-SKEW)
    for env, offset in ((ahead, SKEW), (behind, -SKEW)):  # the premise: the clocks are off
        assert abs(clock_offset(env, _redis_time(platform)) - offset) < 10
    roles = {"ahead": {**TIMERS, **ahead}, "behind": {**TIMERS, **behind}, "normal": TIMERS}
    started_hosts = {
        name: hosts.start(name, concurrency=2, env=env, wait=False) for name, env in roles.items()
    }
    for host in started_hosts.values():
        host.wait_ready()
    # Six slots, six jobs: each host runs two (it takes a message only into a free slot).
    every = [running_for(platform, tag, f"{tag}-{i}", RUN).id for i in range(6)]
    started(platform, tag, 6)
    on = {
        name: [j for j in every if host.owns(job_row(platform, j)["lease_owner"])]
        for name, host in started_hosts.items()
    }
    assert [len(jobs) for jobs in on.values()] == [2, 2, 2], story(platform, every)

    # Three leases long, every host's relay reconciles in turn: nothing is taken over.
    relays = RelayClocks(platform)
    try:
        watch = time.monotonic() + 3 * LEASE
        while time.monotonic() < watch:
            rows = [job_row(platform, j) for j in every]
            states = [(r["status"], r["attempts"]) for r in rows]
            assert states == [(s.RUNNING, 1)] * 6, story(platform, every)
            time.sleep(0.1)
    finally:
        relays.close()
    assert relays.seen == {-1, 0, 1}, relays.seen  # the skewed relays did pass

    # The normal host dies: the skewed relays take its jobs over after the lease, no sooner.
    started_hosts["normal"].kill()
    beat = {j: job_row(platform, j)["heartbeat_at"] for j in on["normal"]}
    for job_id in on["normal"]:
        taken = eventually(lambda job_id=job_id: takeovers(platform, job_id), timeout=30)
        waited = taken[0] - beat[job_id]
        assert dt.timedelta(seconds=LEASE) <= waited < dt.timedelta(seconds=LEASE + 15), waited
    skewed_jobs = on["ahead"] + on["behind"]
    rows = [job_row(platform, j) for j in skewed_jobs]
    assert [(r["status"], r["attempts"]) for r in rows] == [(s.RUNNING, 1)] * 4, story(platform, every)

    for job_id in every:
        eventually(lambda job_id=job_id: job_row(platform, job_id)["status"] == s.SUCCEEDED, timeout=3 * RUN)
    assert [job_row(platform, j)["attempts"] for j in skewed_jobs + on["normal"]] == [1, 1, 1, 1, 2, 2]
    assert all(effect_count(platform, job_id=j) == 1 for j in every)


def _submit_from(platform: Any, hostname: str, env: dict[str, str], key: str) -> str:
    code = SUBMIT.format(key=key, ttl=TTL)
    return run_in(hostname, {**TIMERS, **env}, code, platform.settings).strip().splitlines()[-1]


def _expires_in(platform: Any, key: str) -> float:
    """How long the throttle window of ``key`` still runs, on Redis's clock."""
    with platform.engine.connect() as conn:
        expires_ms = conn.execute(
            select(dedup_keys.c.expires_ms).where(
                dedup_keys.c.scope == "conveyor.demo.square", dedup_keys.c.key == key
            )
        ).scalar_one()
    return float(expires_ms) / 1000 - _redis_time(platform)


def test_skewed_submitters_end_no_dedup_window_early(platform: Any, tag: str) -> None:
    ahead, behind = skewed(+SKEW), skewed(-SKEW)

    def here(key: str) -> str:
        return str(
            platform.submit(
                "conveyor.demo.square", {"n": 1}, dedup=Dedup(mode="throttle", key=key, ttl=TTL)
            ).id
        )

    def uncached(key: str) -> None:  # the next submit asks Postgres, the authority
        platform.deduper.forget(f"conveyor.demo.square:{key}")

    # A window opened here: a submitter 90 s ahead is still inside it (cache, then Postgres).
    first = here(f"{tag}-a")
    assert _submit_from(platform, "ahead", ahead, f"{tag}-a") == first
    uncached(f"{tag}-a")
    assert _submit_from(platform, "ahead", ahead, f"{tag}-a") == first
    # A window opened 90 s behind runs its full length: submitters here are inside it.
    second = _submit_from(platform, "behind", behind, f"{tag}-b")
    assert TTL - 15 < _expires_in(platform, f"{tag}-b") <= TTL
    assert here(f"{tag}-b") == second
    uncached(f"{tag}-b")
    assert here(f"{tag}-b") == second
    # And one opened 90 s ahead ends on time, not 90 s late.
    third = _submit_from(platform, "ahead", ahead, f"{tag}-c")
    assert TTL - 15 < _expires_in(platform, f"{tag}-c") <= TTL
    assert here(f"{tag}-c") == third
    assert len({first, second, third}) == 3


BEAT = """
from config.celery_app import platform
platform.deliveries.beat("{worker}")
"""


def test_a_skewed_workers_liveness_beat_is_on_redis_clock(platform: Any, tag: str) -> None:
    """The relay copies the jobs published while a dead worker was dying, by its last beat
    and the database's publish times: a beat on the worker's own clock would point 90 s off."""
    worker = f"worker@ahead:{tag}"
    run_in("ahead", {**TIMERS, **skewed(+SKEW)}, BEAT.format(worker=worker), platform.settings)
    beat = float(platform.redis.hget(f"{platform.settings.key_prefix}workers", worker))
    assert abs(beat - _redis_time(platform)) < 10
    platform.deliveries.forget(worker)
