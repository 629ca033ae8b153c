"""Every attempt starts by checking cancel and expiry, and with no stop request of the last
one: at a first claim, at the takeover of a dead attempt, and at the reconciler's requeue."""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import pytest
from sqlalchemy import update

from conveyor.runfile import owner_id
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.schema import jobs
from conveyor.store.jobs import ClaimOutcome, NewJob

pytestmark = pytest.mark.timeout(60)

ME = owner_id()


def _dead_owner() -> str:
    """The lease owner of a process of this host that has exited."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return owner_id(gone.pid)


def _running(platform: Any, **values: Any) -> str:
    """A job whose first attempt is running under a dead owner, with ``values`` set."""
    store = platform.store
    with platform.engine.begin() as conn:
        job_id, _ = store.insert(
            conn, NewJob(stage="conveyor.demo.effect", queue="demo", payload={}, max_attempts=3)
        )
        assert store.claim(conn, job_id, owner=_dead_owner(), task_id="first").outcome is ClaimOutcome.RUN
        if values:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(**values))
    return job_id


def _claim(platform: Any, job_id: str) -> Any:
    with platform.engine.begin() as conn:
        return platform.store.claim(conn, job_id, owner=ME, task_id="second")


def _row(platform: Any, job_id: str) -> Any:
    with platform.engine.connect() as conn:
        return platform.store.get(conn, job_id)


def test_takeover_of_an_expired_job_ends_it_expired(platform: Any) -> None:
    job_id = _running(platform, expires_at=db_now_plus(-1))
    claim = _claim(platform, job_id)
    assert claim.outcome is ClaimOutcome.TERMINAL
    row = _row(platform, job_id)
    assert row["status"] == s.EXPIRED and row["attempts"] == 1


def test_takeover_of_a_cancelled_job_ends_it_cancelled(platform: Any) -> None:
    job_id = _running(platform, cancel_requested_at=db_now(), cancelled_by="test")
    assert _claim(platform, job_id).outcome is ClaimOutcome.TERMINAL
    row = _row(platform, job_id)
    assert row["status"] == s.CANCELLED and row["attempts"] == 1


def test_a_new_attempt_starts_without_the_old_stop_request(platform: Any) -> None:
    job_id = _running(platform, preempt_requested_at=db_now(), interrupt_sent_at=db_now())
    claim = _claim(platform, job_id)
    assert claim.outcome is ClaimOutcome.RUN and claim.job["attempts"] == 2
    assert claim.job["preempt_requested_at"] is None and claim.job["interrupt_sent_at"] is None
    assert platform.stops.stop_requested_db(job_id, 2) is None


def test_reconciler_ends_a_stale_expired_or_cancelled_job_instead_of_requeueing(platform: Any) -> None:
    stale = db_now_plus(-3600)
    expired = _running(platform, heartbeat_at=stale, expires_at=db_now_plus(-1))
    cancelled = _running(platform, heartbeat_at=stale, cancel_requested_at=db_now())
    plain = _running(platform, heartbeat_at=stale)
    relay = platform.relay()
    relay.tick(reconcile=False)
    with platform.engine.begin() as conn:  # as if this relay had been running all along
        conn.execute(update(s.counters).where(s.counters.c.name == "relay_resumed_ms").values(value=0))
    relay.tick()
    assert _row(platform, expired)["status"] == s.EXPIRED
    assert _row(platform, cancelled)["status"] == s.CANCELLED
    assert _row(platform, plain)["status"] in (s.QUEUED, s.RUNNING, s.SUCCEEDED)


def test_no_lease_is_taken_over_until_a_lease_timeout_after_the_database_came_back(platform: Any) -> None:
    """A stale heartbeat right after an outage (no relay pass for a while) is the outage's
    doing, not a dead owner's: neither the reconciler nor a claim takes the job over."""
    job_id = _running(platform, heartbeat_at=db_now_plus(-3600), lease_owner="otherhost:1")
    relay = platform.relay()
    with platform.engine.begin() as conn:  # the last relay pass was long ago: an outage
        conn.execute(update(s.counters).where(s.counters.c.name == "relay_tick_ms").values(value=0))
    relay.tick()
    assert _row(platform, job_id)["status"] == s.RUNNING
    assert _claim(platform, job_id).outcome is ClaimOutcome.LIVE_LEASE
    with platform.engine.begin() as conn:  # a whole lease timeout later
        conn.execute(update(s.counters).where(s.counters.c.name == "relay_resumed_ms").values(value=0))
    relay.tick()
    assert _row(platform, job_id)["status"] != s.RUNNING or _row(platform, job_id)["attempts"] == 2


def test_an_owner_in_another_pid_namespace_of_the_same_host_is_never_judged_by_pid(platform: Any) -> None:
    """Containers sharing the host's name (host networking) but not its PID namespace: a
    pid that does not exist here may be alive there. Only the lease path may take over."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    job_id = _running(platform, lease_owner=f"{socket.gethostname()}:{gone.pid}")
    assert _claim(platform, job_id).outcome is ClaimOutcome.LIVE_LEASE
    assert _row(platform, job_id)["attempts"] == 1


def test_no_claim_takes_over_before_the_relay_noticed_a_stall(platform: Any) -> None:
    """The relay has not passed for a lease timeout (the database, or SQLite's single
    writer, was held), and no pass has noted it yet: heartbeats were stale for the same
    reason, so a redelivered copy must not take the job over either."""
    job_id = _running(platform, heartbeat_at=db_now_plus(-3600), lease_owner="otherhost:1")
    with platform.engine.begin() as conn:
        conn.execute(update(s.counters).where(s.counters.c.name == "relay_resumed_ms").values(value=0))
        conn.execute(update(s.counters).where(s.counters.c.name == "relay_tick_ms").values(value=0))
    assert _claim(platform, job_id).outcome is ClaimOutcome.LIVE_LEASE
    assert _row(platform, job_id)["attempts"] == 1
