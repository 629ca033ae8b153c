"""Faults of one whole host among several: every process killed at once, its link cut for
longer than a lease. Real prefork workers in network and PID namespaces (see harness.py);
effects are rows without a unique constraint, so a duplicate would show."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from conveyor.db import schema as s
from tests.helpers import effect_count, eventually, job_row
from tests.multihost.conftest import TIMERS
from tests.multihost.harness import Cluster, Host

pytestmark = [pytest.mark.timeout(150), pytest.mark.fault, pytest.mark.multihost]

LEASE = float(TIMERS["CONVEYOR_LEASE_TIMEOUT"])
RECONCILE = float(TIMERS["CONVEYOR_RECONCILER_INTERVAL"])
# What the stale owner logs when the fencing compare-and-set refuses its late write.
REFUSED = re.compile(r"ignored: fenced off|no longer owns the job|was taken over")


def _rows(platform: Any, ids: list[str]) -> dict[str, Any]:
    return {i: job_row(platform, i) for i in ids}


def _owned_by(platform: Any, ids: list[str], host: Host) -> list[str]:
    """The jobs running now under a lease of ``host`` (owners are ``hostname/pidns:pid``)."""
    return [
        i
        for i, r in _rows(platform, ids).items()
        if r["status"] == s.RUNNING and str(r["lease_owner"] or "").startswith(f"{host.name}/")
    ]


def _all_terminal(platform: Any, ids: list[str]) -> dict[str, Any] | None:
    rows = _rows(platform, ids)
    return rows if all(r["status"] in s.TERMINAL for r in rows.values()) else None


def _topics(platform: Any, job_id: str) -> list[Any]:
    return platform.job(job_id).events()[0]


def _assert_exactly_once(platform: Any, ids: list[str], tag: str, timeout: float = 90) -> dict[str, Any]:
    """Every job succeeded, with one effect row and one ``job.succeeded`` event."""
    rows = eventually(lambda: _all_terminal(platform, ids), timeout=timeout, interval=0.25)
    assert {r["status"] for r in rows.values()} == {s.SUCCEEDED}, {i: r["status"] for i, r in rows.items()}
    for i, job_id in enumerate(ids):
        assert effect_count(platform, note=f"{tag}-{i}") == 1, job_id
        assert [e.topic for e in _topics(platform, job_id)].count("job.succeeded") == 1, job_id
    return rows


def _stalled_from(platform: Any, job_id: str, host: Host) -> list[Any]:
    return [
        e
        for e in _topics(platform, job_id)
        if e.topic == "job.stalled" and str(e.body.get("previous_owner") or "").startswith(f"{host.name}/")
    ]


def test_kill_every_process_of_one_host(platform: Any, hosts: Cluster, tag: str) -> None:
    a, _ = hosts.add_host(), hosts.add_host()
    n = 8
    ids = [
        platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", "barrier": tag}).id for i in range(n)
    ]
    # Both hosts' two pool slots hold a job at the barrier.
    eventually(lambda: len(platform.redis.lrange(f"{tag}:started", 0, -1)) >= 4, timeout=60)
    victims = eventually(lambda: _owned_by(platform, ids, a), timeout=10)
    before = len(a.pids())
    killed_at = time.monotonic()
    a.kill()
    assert a.pids() == [], "a process of the killed host survived"
    print(f"killed {before} processes of {a.name} (its PID 1) holding {len(victims)} running job(s)")
    platform.redis.rpush(f"{tag}:go", *["go"] * (3 * n))
    rows = _assert_exactly_once(platform, ids, tag)
    print(f"all {n} jobs terminal {time.monotonic() - killed_at:.1f}s after the kill")
    for job_id in victims:
        assert rows[job_id]["attempts"] >= 2, rows[job_id]
        assert _stalled_from(platform, job_id, a), _topics(platform, job_id)


def test_link_down_longer_than_lease(platform: Any, hosts: Cluster, tag: str) -> None:
    a, b = hosts.add_host(), hosts.add_host()
    sleep = 12.0
    ids = [
        platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", "sleep": sleep}).id for i in range(2)
    ]
    eventually(lambda: all(r["status"] == s.RUNNING for r in _rows(platform, ids).values()), timeout=60)
    victim, other = (a, b) if _owned_by(platform, ids, a) else (b, a)
    cut_off = _owned_by(platform, ids, victim)
    outage = LEASE + RECONCILE + 2.5
    print(
        f"cutting {victim.name}'s link for {outage}s > lease_timeout {LEASE}s + reconciler_interval "
        f"{RECONCILE}s while it runs {len(cut_off)} job(s) of {sleep}s"
    )
    victim.link_down()
    cut_at = time.monotonic()
    try:
        # Another host takes the cut host's jobs over while the link is still down.
        taken = eventually(lambda: _owned_by(platform, cut_off, other), timeout=outage, interval=0.1)
        took = time.monotonic() - cut_at
        print(f"{len(taken)} job(s) taken over by {other.name} {took:.1f}s after the cut")
        time.sleep(max(0.0, outage - (time.monotonic() - cut_at)))
    finally:
        victim.link_up()
    print(f"link restored after {time.monotonic() - cut_at:.1f}s")
    rows = _assert_exactly_once(platform, ids, tag)
    for job_id in cut_off:
        assert _stalled_from(platform, job_id, victim), _topics(platform, job_id)
        assert rows[job_id]["attempts"] >= 2
    # The stale owner's bodies finish after the link is back: their completion reaches
    # Postgres and the fencing compare-and-set refuses it.
    refused = eventually(
        lambda: [line for w in victim.workers for line in w.text().splitlines() if REFUSED.search(line)],
        timeout=30,
    )
    print("refused late writes of the stale owner:\n" + "\n".join(refused))
    assert any(j in line for line in refused for j in cut_off)
