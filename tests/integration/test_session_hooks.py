"""Publishing after the caller's commit without growing SQLAlchemy's listeners: a
``scoped_session`` is resolved to its session, the hooks are installed once per process on
``Session``, and what a session was given to publish lives and dies with its transaction."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from conveyor.db import schema as s
from tests.helpers import job_row

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis_broker]

EVENTS = ("after_commit", "after_soft_rollback", "after_transaction_end", "after_rollback", "after_begin")


def listeners(session: Session) -> dict[str, int]:
    """The listeners ``session`` runs per event (its class's, inherited ones, its own)."""
    return {e: len(getattr(session.dispatch, e)) for e in EVENTS}


def _queued(platform: Any) -> bytes:
    return b"".join(platform.redis.lrange("demo", 0, -1))


def test_a_scoped_session_is_resolved_and_adds_no_listeners(platform: Any, tag: str) -> None:
    """Nobody consumes ``demo`` in this module: a published job's message waits there."""
    scoped = scoped_session(sessionmaker(platform.engine))
    try:
        first = platform.submit("conveyor.demo.effect", {"note": tag}, session=scoped)
        scoped.commit()
        scoped.remove()
        after_first = listeners(scoped()), listeners(Session())
        handles = []
        for i in range(200):
            handles.append(platform.submit("conveyor.demo.effect", {"note": f"{tag}-{i}"}, session=scoped))
            if i % 2:
                scoped.rollback()
            else:
                scoped.commit()
            scoped.remove()
        assert (listeners(scoped()), listeners(Session())) == after_first
    finally:
        scoped.remove()
    queued = _queued(platform)
    assert first.id.encode() in queued
    for i, h in enumerate(handles):
        assert (h.id.encode() in queued) == (i % 2 == 0)
        assert (job_row(platform, h.id) is None) == (i % 2 == 1)


def test_a_session_closed_before_its_commit_publishes_nothing_later(platform: Any, tag: str) -> None:
    """``close()`` ends the transaction without a rollback event: the job's row is gone, and
    a later commit of the same session must not publish it."""
    with Session(platform.engine) as session:
        dropped = platform.submit("conveyor.demo.effect", {"note": tag + "-x"}, session=session)
        session.close()
        kept = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        session.commit()
    queued = _queued(platform)
    assert job_row(platform, dropped.id) is None and dropped.id.encode() not in queued
    assert kept.status() == s.QUEUED and kept.id.encode() in queued


def test_enlisted_takes_a_scoped_session(platform: Any, tag: str) -> None:
    from tasks.demo import effect

    scoped = scoped_session(sessionmaker(platform.engine))
    try:
        with platform.enlisted(scoped):
            handle = effect.delay(note=tag)
        assert handle.id.encode() not in _queued(platform)
        scoped.commit()
    finally:
        scoped.remove()
    assert handle.id.encode() in _queued(platform)
