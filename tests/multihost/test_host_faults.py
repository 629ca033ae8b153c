"""Faults of one whole host among several: every process killed at once, its link cut for
longer than a lease, the host holding the relay's lock cut mid-pass. Real prefork workers
in network and PID namespaces (see harness.py); effects are rows without a unique
constraint, so a duplicate would show."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from conveyor.store.db import schema as s
from conveyor.store.db.dialect import SINGLETON_IDLE_LIMIT_MS
from conveyor.store.db.schema import counters
from conveyor.store.liveness import TICK
from conveyor.upkeep.relay import RELAY_LOCK
from tests.helpers import effect_count, eventually, job_row
from tests.multihost.conftest import TIMERS
from tests.multihost.harness import Cluster, Host

pytestmark = [pytest.mark.timeout(150), pytest.mark.fault, pytest.mark.multihost]

LEASE = float(TIMERS["CONVEYOR_LEASE_TIMEOUT"])
RECONCILE = float(TIMERS["CONVEYOR_RECONCILER_INTERVAL"])
HEARTBEAT = float(TIMERS["CONVEYOR_BROKER_HEARTBEAT"])
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
    on_rabbitmq = hosts.services.broker_url is not None
    sleep = 12.0 + (3 * HEARTBEAT if on_rabbitmq else 0.0)  # outlasts the cut below
    ids = [
        platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", "sleep": sleep}).id for i in range(2)
    ]
    eventually(lambda: all(r["status"] == s.RUNNING for r in _rows(platform, ids).values()), timeout=60)
    victim, other = (a, b) if _owned_by(platform, ids, a) else (b, a)
    cut_off = _owned_by(platform, ids, victim)
    outage = LEASE + RECONCILE + 2.5
    if on_rabbitmq:
        # RabbitMQ keeps sending to the cut host's consumers (the republished job's message
        # too) until it misses two heartbeats; then those deliveries go to the other host.
        outage += 3 * HEARTBEAT
    print(
        f"cutting {victim.name}'s link for {outage}s > lease_timeout {LEASE}s + reconciler_interval "
        f"{RECONCILE}s (+ 3 broker heartbeats of {HEARTBEAT}s on RabbitMQ) while it runs "
        f"{len(cut_off)} job(s) of {sleep}s"
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


def _relay_holder(conn: Any) -> tuple[int, str] | None:
    """The backend holding the relay's advisory lock and its client's address, if any."""
    row = conn.execute(
        text(
            "SELECT a.pid, host(a.client_addr) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = :k AND l.granted"
        ),
        {"k": RELAY_LOCK},
    ).first()
    return (int(row[0]), str(row[1])) if row is not None else None


def test_relay_resumes_on_another_host_when_its_holder_is_cut(
    platform: Any, hosts: Cluster, tag: str
) -> None:
    for _ in range(2):
        hosts.add_host()
    interval = TIMERS["CONVEYOR_RELAY_INTERVAL"]
    print(f"relay_interval {interval}s, the lock transaction's idle limit {SINGLETON_IDLE_LIMIT_MS} ms")
    engine = platform.engine
    tick = select(counters.c.value).where(counters.c.name == TICK)
    eventually(lambda: _scalar(engine, tick) is not None, timeout=30)
    with engine.connect() as watch, engine.connect() as blocker:
        # Holding the relay clock's row makes the next pass wait in its first statement
        # after taking the lock: the cut then finds the holder mid-transaction, as a cut
        # at any moment of a pass would.
        blocker.begin()
        blocker.execute(tick.with_for_update())
        found = eventually(
            lambda: (h := _relay_holder(watch)) and (host := hosts.host_of(h[1])) and (h[0], host),
            timeout=10,
            interval=0.05,
        )
        watch.rollback()
        backend, holder = found
        before = _scalar(engine, tick)
        holder.link_down()
        cut_at = time.monotonic()
        blocker.rollback()
    try:
        job = platform.submit("conveyor.demo.effect", {"note": f"{tag}-0"}, delay=0.5)

        def active(pid: int) -> bool:
            q = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
            return bool(_scalar(engine, q, p=pid))

        eventually(lambda: not active(backend), timeout=15, interval=0.1)
        freed = time.monotonic() - cut_at
        eventually(lambda: (_scalar(engine, tick) or 0) > (before or 0), timeout=15, interval=0.1)
        resumed = time.monotonic() - cut_at
        eventually(lambda: job_row(platform, job.id)["published_at"] is not None, timeout=15, interval=0.1)
        published = time.monotonic() - cut_at
        holder_now = eventually(lambda: _relay_holder_once(engine), timeout=10, interval=0.01)
        print(
            f"cut {holder.name} holding the relay lock (backend {backend}); Postgres ended its "
            f"transaction after {freed:.1f}s; a relay pass committed after {resumed:.1f}s; a delayed job "
            f"was published after {published:.1f}s; the lock is now held from {holder_now[1]}"
        )
        assert holder_now[1] != holder.address
        assert resumed <= 10 and published <= 10
        # Ended by the lock transaction's own idle limit (keepalives and tcp_user_timeout
        # are longer here).
        log = Path(hosts.services.postgres.datadir / "log").read_text(errors="replace")
        ended = [line for line in log.splitlines() if f"[{backend}] FATAL" in line]
        print("\n".join(ended))
        assert any("idle-in-transaction timeout" in line for line in ended), ended
    finally:
        holder.link_up()
    _assert_exactly_once(platform, [job.id], tag)


def _relay_holder_once(engine: Any) -> tuple[int, str] | None:
    with engine.connect() as conn:
        return _relay_holder(conn)


def _scalar(engine: Any, q: Any, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(q, params).scalar_one_or_none()
