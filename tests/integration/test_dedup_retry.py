"""A DLQ retry takes its job's dedup id again by the decision ``submit()`` would take: under
every mode and every ``reuse`` value the job was submitted with, whatever state the job now
holding the id is in and whether its window passed. Where that submit would be
deduplicated into another job, the retry is refused naming that job.

Each case: J1 (submitted with the mode and ``reuse`` under test) dies; J2 takes the id
(``reuse="always"``) and is left queued, running, succeeded, dead or cancelled, inside or
past its window (a virtual dedup clock). A submit of J1's payload, rolled back, is the
oracle; the retry, of one entry or of all, must agree with it and with the model below.
No worker runs: jobs change state through the store's own transitions.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.dedup import Dedup
from conveyor.errors import RetryRefused
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters, dedup_keys, jobs
from tests.helpers import cancelling_leftovers, dead_letter_for, job_row
from tests.integration.http_support import Token, auth, problem, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("admin")
STAGE = "conveyor.demo.keyed"
TTL = 60.0
MODES = ("simple", "throttle", "debounce", "id")
REUSES = ("never", "if_failed", "always")
HOLDERS = (s.QUEUED, s.RUNNING, s.SUCCEEDED, s.DEAD, s.CANCELLED)


@pytest.fixture
def clock(platform: Any) -> Iterator[list[float]]:
    """The dedup clock, virtual: ``clock[0]`` is now."""
    now = [2_000_000_000.0]
    platform.deduper.clock = lambda: now[0]
    try:
        yield now
    finally:
        platform.deduper.clock = platform.deduper.redis_time


def _policy(mode: str, scope: str) -> Dedup:
    if mode == "id":
        return Dedup(mode="id", fields=("user",), scope=scope)
    return Dedup(mode=mode, key="u:{user}", ttl=TTL, window=TTL, scope=scope)  # type: ignore[arg-type]


def _dead(platform: Any, job_id: str) -> int:
    """Dead-letter a queued job as a worker does; its open entry's id."""
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, job_id)
        assert platform.store.dead_letter(
            conn, row, error_type="PermanentError", message="boom", tb_text=None, from_status=(s.QUEUED,)
        )
    platform.finished(job_id, s.DEAD, dedup_key=row["dedup_key"])
    return int(dead_letter_for(platform, job_id)["id"])


def _put(platform: Any, job_id: str, status: str) -> None:
    """Move a queued job to ``status`` as its life would have."""
    if status == s.DEAD:
        _dead(platform, job_id)
    elif status == s.CANCELLED:
        assert platform.cancel(job_id) == s.CANCELLED
    elif status in (s.RUNNING, s.SUCCEEDED):
        with platform.engine.begin() as conn:
            conn.execute(
                update(jobs).where(jobs.c.id == job_id).values(status=status, published_at=jobs.c.created_at)
            )
        if status == s.SUCCEEDED:
            platform.finished(job_id, s.SUCCEEDED, dedup_key="set")


def _end(platform: Any, job_id: str) -> None:
    """Nothing of a case runs later: a running one ends as if it had, the rest are cancelled."""
    with platform.engine.begin() as conn:
        running = update(jobs).where(jobs.c.id == job_id, jobs.c.status == s.RUNNING)
        conn.execute(running.values(status=s.SUCCEEDED))
    platform.cancel(job_id)


def _submit_would_return(platform: Any, payload: dict[str, Any], policy: Dedup, reuse: str) -> str | None:
    """The oracle: the job a submit of ``payload`` now is deduplicated into, or None (it
    would run as a new job). Rolled back: it leaves nothing."""
    with Session(platform.engine) as session:
        handle = platform.submit(STAGE, payload, session=session, dedup=policy, reuse=reuse, delay=3600)
        session.rollback()
    return handle.id if handle.deduplicated else None


def _expected_free(mode: str, reuse: str, holder: str, past: bool) -> bool:
    """The model: whether a submit takes the id from J2 (submit's modes, then ``reuse``)."""
    if reuse == "always" or (reuse == "if_failed" and holder in (s.DEAD, s.CANCELLED)):
        return True
    if mode == "simple":
        return holder in (s.SUCCEEDED, s.DEAD, s.CANCELLED)
    if mode == "debounce":
        return past or holder != s.QUEUED  # a holder that started closed its window
    return past


def _holder_of(platform: Any, scope: str) -> str:
    with platform.engine.connect() as conn:
        return str(conn.execute(select(dedup_keys.c.job_id).where(dedup_keys.c.scope == scope)).scalar_one())


def _is_open(platform: Any, entry: int) -> bool:
    with platform.engine.connect() as conn:
        q = select(dead_letters.c.retried_at).where(dead_letters.c.id == entry)
        return conn.execute(q).scalar() is None


def test_dlq_retry_takes_the_dedup_decision_of_submit(platform: Any, clock: list[float], tag: str) -> None:
    cases = [
        (mode, reuse, holder, past)
        for mode, reuse, holder, past in itertools.product(MODES, REUSES, HOLDERS, (False, True))
        if not (mode == "simple" and past)  # simple has no window
    ]
    seen = {"refused": 0, "retried": 0}
    with cancelling_leftovers(platform):
        for i, (mode, reuse, holder, past) in enumerate(cases):
            case = (mode, reuse, holder, past)
            scope = f"{tag}-{i}"
            policy = _policy(mode, scope)
            payload = {"user": tag, "note": f"{tag}-{i}"}
            j1 = platform.submit(STAGE, payload, dedup=policy, reuse=reuse, delay=3600)
            entry = _dead(platform, j1.id)
            j2 = platform.submit(STAGE, {**payload, "note": "j2"}, dedup=policy, reuse="always", delay=3600)
            assert not j2.deduplicated and _holder_of(platform, scope) == j2.id, case
            _put(platform, j2.id, holder)
            held = platform.settings.retention_days * 86400 if mode == "id" else TTL
            clock[0] += (held + 1.0) if past else 1.0
            oracle = _submit_would_return(platform, payload, policy, reuse)
            assert oracle in (None, j2.id), case
            assert (oracle is None) == _expected_free(mode, reuse, holder, past), case
            refusals: list[RetryRefused] = []
            try:
                if i % 2:  # retry-all takes the same decision, entry by entry (J1's alone here)
                    at, tick = dead_letter_for(platform, j1.id)["created_at"], dt.timedelta(microseconds=1)
                    retried = platform.dlq.retry_all(stage=STAGE, since=at, until=at + tick, refused=refusals)
                    assert retried == ([] if refusals else [j1.id]), case
                else:
                    assert platform.dlq.retry(entry) == j1.id, case
            except RetryRefused as exc:
                refusals.append(exc)
            if oracle is None:
                assert not refusals, (case, refusals)
                assert job_row(platform, j1.id)["status"] == s.QUEUED, case
                assert _holder_of(platform, scope) == j1.id, case
                seen["retried"] += 1
            else:
                assert len(refusals) == 1 and refusals[0].holder == j2.id, (case, refusals)
                assert j2.id in str(refusals[0]), case
                assert job_row(platform, j1.id)["status"] == s.DEAD and _is_open(platform, entry), case
                assert _holder_of(platform, scope) == j2.id, case
                seen["refused"] += 1
            _end(platform, j1.id)
            _end(platform, j2.id)
    assert seen["refused"] > 10 and seen["retried"] > 10, seen


def test_retry_of_a_dead_id_job_is_refused_once_a_resubmit_succeeded(
    platform: Any, clock: list[float], tag: str
) -> None:
    """The issue's case: ``Dedup(mode="id")`` with ``reuse="if_failed"``; J1 died, its
    resubmit J2 succeeded: the work is done, so the retry is refused naming J2."""
    policy = Dedup(mode="id", fields=("user",), scope=tag)
    payload = {"user": tag, "note": "1"}
    with cancelling_leftovers(platform):
        j1 = platform.submit(STAGE, payload, dedup=policy, reuse="if_failed", delay=3600)
        entry = _dead(platform, j1.id)
        j2 = platform.submit(STAGE, payload, dedup=policy, reuse="if_failed", delay=3600)
        assert not j2.deduplicated
        _put(platform, j2.id, s.SUCCEEDED)
        with pytest.raises(RetryRefused, match=f"job {j2.id} holds dedup id .* ended succeeded") as refused:
            platform.dlq.retry(entry)
        assert refused.value.holder == j2.id
        assert job_row(platform, j1.id)["status"] == s.DEAD and _is_open(platform, entry)


@pytest.mark.parametrize("reuse", ["never", "always"])
def test_http_retry_takes_the_same_decision(
    http: Any, platform: Any, token: Token, tag: str, reuse: str
) -> None:
    """Over HTTP: J1 (keyed by user, submitted with ``reuse``) died and J2 holds the id,
    queued. ``never``: a submit would return J2, so 409 naming it; ``always``: a submit
    would take the id, so the retry does."""
    admin = auth(token(f"ops-{tag}"))
    body = {"stage": STAGE, "payload": {"user": tag, "note": "1"}, "delay": 3600, "reuse": reuse}
    with cancelling_leftovers(platform):
        j1 = http.post("/jobs", json=body, headers=admin).json()["id"]
        entry = _dead(platform, j1)
        j2 = http.post("/jobs", json={**body, "reuse": "never"}, headers=admin).json()
        assert not j2["deduplicated"]
        resp = http.post(f"/dead-letters/{entry}/retry", headers=admin)
        if reuse == "never":
            detail = problem(resp, 409, "retry-refused")["detail"]
            assert f"job {j2['id']} holds dedup id" in detail and "has not finished (queued)" in detail
            assert job_row(platform, j1)["status"] == s.DEAD
        else:
            assert resp.status_code == 200, resp.text
            assert job_row(platform, j1)["status"] == s.QUEUED
