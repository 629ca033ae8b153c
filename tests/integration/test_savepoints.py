"""Publishing after commit, with savepoints in the caller's transaction (Django's nested
``atomic()`` blocks are savepoints): a job survives a rolled-back savepoint it was not in,
and is published at commit — not 'republish_after' later by the relay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from conveyor.dedup import Dedup
from conveyor.store.db import schema as s
from tests.helpers import job_row

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis_broker]


class Boom(Exception):
    pass


def _queue_len(platform: Any) -> int:
    return int(platform.redis.llen("demo"))


def _published_now(platform: Any, handle: Any) -> bool:
    """A message for the job reached the broker (nobody consumes the queue in this module)."""
    row = job_row(platform, handle.id)
    return row is not None and row["published_at"] is not None


def _assert_sent(platform: Any, before: int, handles: list[Any]) -> None:
    assert _queue_len(platform) == before + len(handles)
    for h in handles:
        assert h.status() == s.QUEUED and _published_now(platform, h)


def test_submit_before_a_rolled_back_savepoint_is_published_at_commit(platform: Any, tag: str) -> None:
    before = _queue_len(platform)
    with Session(platform.engine) as session:
        kept = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        with pytest.raises(Boom), session.begin_nested():
            dropped = platform.submit("conveyor.demo.effect", {"note": tag + "-x"}, session=session)
            raise Boom
        session.commit()
    _assert_sent(platform, before, [kept])
    assert job_row(platform, dropped.id) is None


def test_submit_after_a_rolled_back_savepoint_is_published_at_commit(platform: Any, tag: str) -> None:
    before = _queue_len(platform)
    with Session(platform.engine) as session:
        with pytest.raises(Boom), session.begin_nested():
            dropped = platform.submit("conveyor.demo.effect", {"note": tag + "-x"}, session=session)
            raise Boom
        kept = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        session.commit()
    _assert_sent(platform, before, [kept])
    assert job_row(platform, dropped.id) is None


def test_nested_savepoints_keep_what_was_released(platform: Any, tag: str) -> None:
    before = _queue_len(platform)
    with Session(platform.engine) as session:
        outer = platform.submit("conveyor.demo.effect", {"note": tag + "-a"}, session=session)
        with session.begin_nested():
            released = platform.submit("conveyor.demo.effect", {"note": tag + "-b"}, session=session)
            with pytest.raises(Boom), session.begin_nested():
                inner = platform.submit("conveyor.demo.effect", {"note": tag + "-c"}, session=session)
                raise Boom
        with pytest.raises(Boom), session.begin_nested():
            with session.begin_nested():
                gone = platform.submit("conveyor.demo.effect", {"note": tag + "-d"}, session=session)
            raise Boom
        session.commit()
    _assert_sent(platform, before, [outer, released])
    assert job_row(platform, inner.id) is None and job_row(platform, gone.id) is None


def test_whole_rollback_publishes_nothing(platform: Any, tag: str) -> None:
    before = _queue_len(platform)
    with Session(platform.engine) as session:
        a = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        with session.begin_nested():
            b = platform.submit("conveyor.demo.effect", {"note": tag + "-b"}, session=session)
        session.rollback()
    assert _queue_len(platform) == before
    assert job_row(platform, a.id) is None and job_row(platform, b.id) is None


def test_session_joined_to_an_outer_transaction_publishes_when_that_commits(platform: Any, tag: str) -> None:
    """A session bound to a connection whose transaction someone else owns (a test
    fixture's, a framework's): its commit is only a savepoint release. The job is published
    when the outer transaction commits (by the relay, within its interval), never before,
    and never if the outer transaction rolls back."""

    before = _queue_len(platform)
    with platform.engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        kept = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        session.commit()
        assert _queue_len(platform) == before  # nothing published at the savepoint release
        outer.commit()
    with platform.engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        gone = platform.submit("conveyor.demo.effect", {"note": tag + "-x"}, session=session)
        session.commit()
        outer.rollback()
    platform.relay().tick(reconcile=False)  # publishes every due job, not only this test's
    queued = b"".join(platform.redis.lrange("demo", 0, -1))
    assert kept.id.encode() in queued and _published_now(platform, kept)
    assert job_row(platform, gone.id) is None


def test_a_raw_sql_savepoint_rolled_back_publishes_no_ghost_and_holds_no_key(
    platform: Any, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A savepoint the session never saw (``SAVEPOINT``/``ROLLBACK TO SAVEPOINT`` as raw
    SQL) takes the job's row and its dedup key away before the commit: nothing is
    published, no dedup holder is cached for it, and the next submit of the key runs."""
    policy = Dedup(mode="simple", key="raw:{note}")
    with Session(platform.engine) as session:
        session.execute(text("SAVEPOINT raw1"))
        ghost = platform.submit("conveyor.demo.effect", {"note": tag}, dedup=policy, session=session)
        session.execute(text("ROLLBACK TO SAVEPOINT raw1"))
        session.commit()
    assert job_row(platform, ghost.id) is None
    assert ghost.id.encode() not in b"".join(platform.redis.lrange("demo", 0, -1))
    assert f"{ghost.id} (conveyor.demo.effect)" in caplog.text and "not published" in caplog.text
    again = platform.submit("conveyor.demo.effect", {"note": tag}, dedup=policy)
    assert not again.deduplicated and again.id != ghost.id
    assert job_row(platform, again.id) is not None


class _HooksSkipped:
    """A framework's transaction whose after-commit hooks never ran: Django runs no later
    ``on_commit`` hook once one of the app's raised (and a process may die right there)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def connection(self) -> Connection:
        return self._conn

    def after_commit(self, fn: Callable[[], None], job_id: str) -> None:
        pass


def test_a_committed_job_whose_publish_hook_never_ran_is_published_by_the_next_relay_pass(
    platform: Any, tag: str
) -> None:
    """Not ``republish_after`` (300 s) later: the next relay pass publishes it. A job whose
    hook did run is not published a second time by that pass."""
    with platform.engine.begin() as conn:
        skipped = platform.submit("conveyor.demo.effect", {"note": tag}, session=_HooksSkipped(conn))
    with Session(platform.engine) as session:
        hooked = platform.submit("conveyor.demo.effect", {"note": tag + "-h"}, session=session)
        session.commit()
    assert job_row(platform, skipped.id)["status"] == s.QUEUED
    platform.relay().tick(reconcile=False)
    queued = platform.redis.lrange("demo", 0, -1)
    assert [m for m in queued if skipped.id.encode() in m] != [] and _published_now(platform, skipped)
    assert len([m for m in queued if hooked.id.encode() in m]) == 1
