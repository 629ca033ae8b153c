"""Publishing after the caller's commit without growing SQLAlchemy's listeners: a
``scoped_session`` is resolved to its session, the hooks are installed once per process on
``Session``, and what a session was given to publish lives and dies with its transaction."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from conveyor.store.db import schema as s
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


def _dropped_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "conveyor.submit" and r.levelno == logging.WARNING and "not committed" in r.getMessage()
    ]


def test_a_session_ended_without_a_commit_warns_once_naming_its_jobs(
    platform: Any, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A forgotten commit (a Flask handler's: Flask-SQLAlchemy removes the session at the
    end of the request) or a rollback drops the jobs submitted in the session: one warning
    names them and their stages, never their payloads."""
    caplog.set_level(logging.WARNING, logger="conveyor.submit")
    scoped = scoped_session(sessionmaker(platform.engine))
    try:
        a = platform.submit("conveyor.demo.effect", {"note": tag}, session=scoped)
        b = platform.submit("conveyor.demo.square", {"n": 4}, session=scoped)
        scoped.remove()  # closed, never committed
        (closed,) = _dropped_warnings(caplog)
        assert f"{a.id} (conveyor.demo.effect)" in closed and f"{b.id} (conveyor.demo.square)" in closed
        assert tag not in closed.replace(a.id, "")

        caplog.clear()
        c = platform.submit("conveyor.demo.effect", {"note": tag + "-c"}, session=scoped)
        with scoped.begin_nested():
            d = platform.submit("conveyor.demo.effect", {"note": tag + "-d"}, session=scoped)
        scoped.rollback()
        scoped.remove()
        (rolled,) = _dropped_warnings(caplog)
        assert c.id in rolled and d.id in rolled and "without a commit" in rolled

        caplog.clear()
        kept = platform.submit("conveyor.demo.effect", {"note": tag + "-k"}, session=scoped)
        scoped.commit()
        scoped.remove()
        assert _dropped_warnings(caplog) == [] and kept.status() == s.QUEUED
    finally:
        scoped.remove()
    assert all(job_row(platform, h.id) is None for h in (a, b, c, d))
