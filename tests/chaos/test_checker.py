"""The checker itself: a database state with one of each problem must be reported as such
(so that the chaos runs' zeros mean something). No workers: rows are written directly."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import text

from conveyor.store.jobs import NewJob
from tasks.demo.logic import record_effect
from tests.chaos.checker import ClaimLog, ExpectedJob, Kill, check, db_now, p95

EFFECT = "conveyor.demo.effect"


def _job(platform: Any, note: str) -> str:
    new = NewJob(stage=EFFECT, queue="demo", payload={"note": note}, max_attempts=4)
    with platform.engine.begin() as conn:
        platform.store.insert(conn, new)
    return new.id


def _claim(platform: Any, job_id: str, at: dt.datetime, owner: str = "elsewhere:1") -> None:
    with platform.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE jobs SET status = 'running', attempts = attempts + 1, started_at = :at, "
                "lease_owner = :owner WHERE id = :id"
            ),
            {"id": job_id, "at": at, "owner": owner},
        )


def _set(platform: Any, job_id: str, status: str, *, effect: int = 0, note: str | None = None) -> None:
    with platform.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET status = :s WHERE id = :id"), {"id": job_id, "s": status})
        attempts = conn.execute(text("SELECT attempts FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()
        for _ in range(effect):
            record_effect(conn, job_id=job_id, stage=EFFECT, attempt=int(attempts), note=note)


def test_checker_reports_each_kind_of_problem(platform: Any, tag: str) -> None:
    log = ClaimLog(platform.engine, f"{tag}_self")
    log.install()
    try:
        expected: list[ExpectedJob] = []

        def job(name: str, kind: str = "single", head: str | None = None) -> str:
            note = f"{tag}-{name}"
            job_id = _job(platform, note)
            expected.append(ExpectedJob(job_id, note, kind, head))
            return job_id

        t0 = db_now(platform.engine) - dt.timedelta(seconds=60)
        ok = job("ok")
        _claim(platform, ok, t0)
        _set(platform, ok, "succeeded", effect=1, note=f"{tag}-ok")
        no_effect = job("no-effect")
        _claim(platform, no_effect, t0)
        _set(platform, no_effect, "succeeded")
        twice = job("twice")
        _claim(platform, twice, t0)
        _set(platform, twice, "succeeded", effect=2, note=f"{tag}-twice")
        job("stuck")  # never claimed: nonterminal
        dead = job("dead")
        _claim(platform, dead, t0)
        _set(platform, dead, "dead")
        # Killed four times (its whole budget) by the run itself, then dead: excused. Each
        # kill is followed by a claim 2 s later, the last by the burial.
        killed = job("killed")
        kills = []
        _claim(platform, killed, t0 - dt.timedelta(seconds=1), owner="here:42")
        for i in range(4):
            at = t0 + dt.timedelta(seconds=10 * i)
            kills.append(Kill("group", at, at, frozenset({42}), {(killed, i + 1)}))
            if i < 3:
                _claim(platform, killed, at + dt.timedelta(seconds=2 + i), owner="here:42")
        _set(platform, killed, "dead")
        head = job("head", "head")
        _claim(platform, head, t0)
        _set(platform, head, "succeeded", effect=1, note=f"{tag}-head")
        expected.append(ExpectedJob(str(uuid.uuid4()), f"{tag}-tail", "tail", head))  # never created: lost
        with platform.engine.begin() as conn:
            record_effect(conn, job_id=str(uuid.uuid4()), stage=EFFECT, attempt=1, note=f"{tag}-stray")

        res = check(
            platform.engine,
            expected=expected,
            note_prefix=f"{tag}-",
            claim_log=log,
            kills=kills,
            worker_crashes=["worker A#0: Unrecoverable error"],
        )
    finally:
        log.uninstall()
    assert len(res.lost) == 2, res.lost  # no-effect, tail
    assert len(res.duplicated) == 1 and len(res.unexpected) == 1  # "twice"; the stray row
    assert len(res.nonterminal) == 1 and len(res.dead) == 1 and len(res.excused_dead) == 1
    assert len(res.worker_crashes) == 1
    # Three claims 2, 3, 4 s after a kill, and the burial after the last one.
    assert sorted(round(x) for x in res.recovery[:3]) == [2, 3, 4] and len(res.recovery) == 4
    assert res.line().startswith("lost=2 duplicated=1 unexpected=1 nonterminal=1 dead=1 worker_crashes=1 ")


def test_p95_is_nearest_rank() -> None:
    assert p95([float(i) for i in range(1, 21)]) == 19.0
    assert p95([1.0] * 19 + [99.0]) == 1.0
    assert p95([1.0] * 18 + [99.0, 99.0]) == 99.0


def test_a_queue_wait_across_a_later_fault_counts_from_that_fault(platform: Any, tag: str) -> None:
    """A victim requeued 8 s after its kill, then waiting while another worker is killed
    4 s later and claimed 7 s after that: its recovery is 8 + 7 s, not the 19 s from its
    kill (the second kill's lost capacity is that kill's recovery). Without a later fault
    the whole wait counts."""
    log = ClaimLog(platform.engine, f"{tag}_wait")
    log.install()
    try:
        expected: list[ExpectedJob] = []
        now = db_now(platform.engine)
        ids = []
        for name in ("crossed", "alone"):
            note = f"{tag}-{name}"
            job_id = _job(platform, note)
            expected.append(ExpectedJob(job_id, note, "single"))
            _claim(platform, job_id, now - dt.timedelta(seconds=9), owner="here:7")
            ids.append(job_id)
        freed = db_now(platform.engine)
        for job_id in ids:
            _set(platform, job_id, "queued")  # requeued, at about ``freed``
        killed = freed - dt.timedelta(seconds=8)
        first = Kill("group", killed, killed, frozenset({7}), {(ids[0], 1), (ids[1], 1)})
        second_at = freed + dt.timedelta(seconds=4)
        second = Kill("group", second_at, second_at, frozenset({8}))
        _claim(platform, ids[0], freed + dt.timedelta(seconds=11))
        _claim(platform, ids[1], freed + dt.timedelta(seconds=3))
        for job_id, name in zip(ids, ("crossed", "alone"), strict=True):
            _set(platform, job_id, "succeeded", effect=1, note=f"{tag}-{name}")
        res = check(
            platform.engine, expected=expected, note_prefix=f"{tag}-", claim_log=log, kills=[first, second]
        )
    finally:
        log.uninstall()
    assert sorted(round(x) for x in res.recovery) == [11, 15], res.recovery_notes
