"""The relay under a backlog: a long queue is not a lost message.

5,000 jobs stay queued with nobody consuming, through 30 republish periods (shortened by
settings): the broker must hold at most 1.05 messages per queued job. After a Redis wipe
each job is republished exactly once for the new epoch. A copy that does reach a worker
is discarded without a Postgres write. No worker runs in this module except the last test's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, insert, literal_column, select, update

from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import job_events, jobs
from tests.helpers import discarded, eventually, publish_again

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_broker]

N = 5_000
PERIOD = 0.2  # republish_after for this module
QUEUE = "demo"


@pytest.fixture
def fast_republish(platform: Any) -> Iterator[Any]:
    saved = platform.settings
    platform.settings = saved.model_copy(update={"republish_after": PERIOD})
    try:
        yield platform
    finally:
        platform.settings = saved


def _messages(platform: Any) -> int:
    return platform.broker.message_counts([QUEUE])[QUEUE]


def _waiting(platform: Any, tag: str) -> int:
    with platform.engine.connect() as conn:
        q = select(func.count()).where(jobs.c.label == tag, jobs.c.status.in_(s.CLAIMABLE))
        return int(conn.execute(q).scalar_one())


def _waiting_in_queue(platform: Any) -> int:
    """Every job waiting on the queue: this test's, and any an earlier test left queued."""
    with platform.engine.connect() as conn:
        q = select(func.count()).where(jobs.c.queue == QUEUE, jobs.c.status.in_(s.CLAIMABLE))
        return int(conn.execute(q).scalar_one())


def _submit_backlog(platform: Any, tag: str) -> None:
    # Rows as submit() writes them, in bulk (the submit path itself is tested elsewhere),
    # then every message published, as the relay would the first time.
    rows = [
        {
            "id": f"{tag}-{i:05d}",
            "stage": "conveyor.demo.noop",
            "queue": QUEUE,
            "status": s.QUEUED,
            "priority": 0,
            "payload": {"n": i},
            "label": tag,
            "attempts": 0,
            "max_attempts": 3,
            "options": {},
        }
        for i in range(N)
    ]
    with platform.engine.begin() as conn:
        conn.execute(
            insert(jobs).values(run_at=db_now(), created_at=db_now(), updated_at=db_now()),
            rows,
        )
    relay = platform.relay()
    while _unpublished(platform, tag):
        relay.tick(reconcile=False)


def _unpublished(platform: Any, tag: str) -> int:
    with platform.engine.connect() as conn:
        q = select(func.count()).where(jobs.c.label == tag, jobs.c.published_at.is_(None))
        return int(conn.execute(q).scalar_one())


def _periods(platform: Any, n: int) -> None:
    relay = platform.relay()
    for _ in range(n):
        time.sleep(PERIOD)
        relay.tick()


def _cleanup(platform: Any, tag: str) -> None:
    with platform.engine.begin() as conn:
        conn.execute(
            update(jobs)
            .where(jobs.c.label == tag, jobs.c.status.in_(s.CLAIMABLE))
            .values(status=s.CANCELLED, finished_at=db_now())
        )
    for key in platform.redis.scan_iter(f"{QUEUE}*"):
        platform.redis.delete(key)


def test_backlog_is_not_multiplied_and_a_wipe_republishes_once(fast_republish: Any, tag: str) -> None:
    platform = fast_republish
    for key in platform.redis.scan_iter(f"{QUEUE}*"):
        platform.redis.delete(key)
    try:
        _submit_backlog(platform, tag)
        waiting = _waiting(platform, tag)
        assert waiting == N
        assert _messages(platform) == N
        _periods(platform, 30)
        ratio = _messages(platform) / _waiting_in_queue(platform)
        print(f"backlog_messages_per_queued_job={ratio:.4f}")
        assert ratio <= 1.05, "the relay multiplied the backlog"

        # Redis wiped: every job is republished once for the new epoch, then no more.
        platform.redis.flushdb()
        relay = platform.relay()
        for _ in range(N // 500 + 2):
            relay.tick(reconcile=False)
        assert _messages(platform) == _waiting_in_queue(platform)
        with platform.engine.connect() as conn:
            epochs = conn.execute(
                select(func.count(func.distinct(jobs.c.broker_epoch))).where(jobs.c.label == tag)
            ).scalar_one()
        assert epochs == 1
        _periods(platform, 10)  # and the new epoch's messages are not multiplied either
        assert _messages(platform) <= 1.05 * _waiting_in_queue(platform)

        # A lost message is still found: drop 100 messages, they come back (and no more).
        for _ in range(100):
            platform.redis.rpop(QUEUE)
        _periods(platform, 3)
        total = _waiting_in_queue(platform)
        assert total <= _messages(platform) <= 1.05 * total
    finally:
        _cleanup(platform, tag)


def _writes(platform: Any, job_id: str) -> tuple[Any, int]:
    """The job row's version (xmin) and how many events it has."""
    with platform.engine.connect() as conn:
        xmin = conn.execute(
            select(literal_column("xmin")).select_from(jobs).where(jobs.c.id == job_id)
        ).scalar()
        events = conn.execute(select(func.count()).where(job_events.c.job_id == job_id)).scalar_one()
    return xmin, int(events)


def test_duplicate_copy_is_discarded_without_a_postgres_write(platform: Any, worker: Any, tag: str) -> None:
    done = platform.submit("conveyor.demo.effect", {"note": tag})
    assert done.wait(30) == s.SUCCEEDED
    before = _writes(platform, done.id)
    row = done.row()
    publish_again(platform, row, task_id=row["celery_task_id"])
    publish_again(platform, row, task_id="another-copy")
    eventually(lambda: len(discarded(platform, done.id)) >= 2, timeout=30)
    assert _writes(platform, done.id) == before
