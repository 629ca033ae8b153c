"""16 threads, each with its own connection, race to claim one job: one winner per round.

Runs on Postgres and on the embedded SQLite store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, delete, insert, select

from conveyor.errors import LeaseLost
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.migrate import upgrade
from conveyor.store.jobs import ClaimOutcome, JobStore, NewJob
from conveyor.store.liveness import RESUMED, TICK
from conveyor.worker.runner import lease_owner
from tasks.demo.models import effects
from tasks.demo.models import metadata as demo_metadata

pytestmark = pytest.mark.timeout(300)

THREADS = 16
ROUNDS = 200


@pytest.fixture(params=["postgres", pytest.param("sqlite", marks=pytest.mark.sqlite)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "postgres":
        request.getfixturevalue("services")
        from config.celery_app import platform

        eng = make_engine(platform.settings.database_url, pool_size=THREADS + 2)
    else:
        eng = make_engine(sqlite_url(tmp_path))
        upgrade(eng)
        demo_metadata.create_all(eng)
    yield eng
    eng.dispose()


def _race(engine: Engine, store: JobStore, job_id: str) -> tuple[list[ClaimOutcome], list[BaseException]]:
    """Every thread opens its own connection, waits on a barrier, then claims."""
    barrier = threading.Barrier(THREADS)
    outcomes: list[ClaimOutcome] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def contend() -> None:
        try:
            with engine.connect() as conn:
                barrier.wait()
                with conn.begin():
                    claim = store.claim(conn, job_id, owner=lease_owner(), task_id="t")
            with lock:
                outcomes.append(claim.outcome)
        except BaseException as exc:  # losers must lose by rowcount, never by exception
            errors.append(exc)

    threads = [threading.Thread(target=contend) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, errors


def test_exactly_one_claim_wins_per_round(engine: Engine) -> None:
    store = JobStore(lease_timeout=60)
    for _ in range(ROUNDS):
        with engine.begin() as conn:
            new = NewJob(stage="conveyor.demo.noop", queue="demo", payload={"n": 1}, max_attempts=3)
            job_id, _ = store.insert(conn, new)
        outcomes, errors = _race(engine, store, job_id)
        assert not errors, errors[:3]
        assert outcomes.count(ClaimOutcome.RUN) == 1, outcomes
        assert set(outcomes) <= {ClaimOutcome.RUN, ClaimOutcome.LIVE_LEASE}


def test_stale_attempts_late_completion_fails_and_rolls_back_its_effect(engine: Engine) -> None:
    store = JobStore(lease_timeout=0.05)
    with engine.begin() as conn:
        job_id, _ = store.insert(
            conn, NewJob(stage="conveyor.demo.effect", queue="demo", payload={}, max_attempts=3)
        )
    with engine.begin() as conn:
        first = store.claim(conn, job_id, owner="otherhost:1", task_id="a")
    assert first.outcome is ClaimOutcome.RUN and first.job is not None
    import time

    time.sleep(0.2)  # the first attempt's lease goes stale
    with engine.begin() as conn:
        # No relay pass clock: a stale lease is a dead owner's (the other counters stay).
        conn.execute(delete(s.counters).where(s.counters.c.name.in_([TICK, RESUMED])))
        second = store.claim(conn, job_id, owner="otherhost:2", task_id="b")
    assert second.outcome is ClaimOutcome.RUN and second.job is not None
    assert second.job["attempts"] == 2

    def complete(attempt: int, note: str) -> None:
        with engine.begin() as conn:
            conn.execute(
                insert(effects).values(
                    job_id=job_id, stage="x", attempt=attempt, note=note, created_at=db_now()
                )
            )
            if not store.succeed(conn, job_id, attempt, {"by": attempt}):
                raise LeaseLost("fenced")

    with pytest.raises(LeaseLost):
        complete(1, "late")
    complete(2, "current")
    with engine.connect() as conn:
        notes = [r.note for r in conn.execute(select(effects.c.note).where(effects.c.job_id == job_id))]
        row = store.get(conn, job_id)
    assert notes == ["current"]
    assert row is not None and row["status"] == s.SUCCEEDED and row["result"] == {"by": 2}
