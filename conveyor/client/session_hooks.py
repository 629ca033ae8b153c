"""Publishing after the caller's commit: the hooks a submit joined to a SQLAlchemy
``Session`` leaves, run once its outermost transaction commits (dropped if it rolls back);
and the time and session values a submit takes."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session, scoped_session

log = logging.getLogger("conveyor.submit")

PENDING_KEY = "conveyor_pending_publish"
Pending = tuple[Any, Callable[[], None], str, str]  # (its session transaction, fn, job id, stage)


def utc_or_none(value: Any) -> dt.datetime | None:
    """An absolute time as an aware UTC datetime (naive ones are taken as UTC)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if not isinstance(value, dt.datetime):
        raise TypeError(f"expected a datetime, got {type(value).__name__}")
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)


def resolved(session: Session | scoped_session[Any]) -> Session:
    """The :class:`Session` a caller means: a ``scoped_session`` (Flask-SQLAlchemy's
    ``db.session``) is resolved to its current session, so nothing is ever hooked on the
    registry, whose events SQLAlchemy applies to the whole session class."""
    return session() if isinstance(session, scoped_session) else session


def after_commit(session: Session, fn: Callable[[], None], job_id: str, stage: str) -> None:
    """Run ``fn`` once ``session``'s outermost transaction commits.

    Dropped if the transaction it was registered in rolls back, or any savepoint around
    it does, or the session is closed first; a savepoint rolled back *beside* it (before
    or after) leaves it alone; the outermost one ending uncommitted logs one warning naming
    the jobs (``job_id`` of ``stage``...). The pending calls live in ``session.info``; the
    listeners that run them are installed once per process on :class:`Session` (so on every
    subclass and ``sessionmaker``), never per session: a long-lived process that
    submits in every request keeps the same listeners.
    """
    _install_listeners()
    current = session.get_nested_transaction() or session.get_transaction()
    session.info.setdefault(PENDING_KEY, []).append((current, fn, job_id, stage))


_install_lock = threading.Lock()
_installed = False


def _install_listeners() -> None:
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            sa_event.listen(Session, "after_commit", _on_commit)
            sa_event.listen(Session, "after_soft_rollback", _on_soft_rollback)
            sa_event.listen(Session, "after_transaction_end", _on_transaction_end)
            _installed = True


def _on_commit(session: Session) -> None:
    if session.get_nested_transaction() is not None:
        return  # a savepoint was released: its work commits (or not) with the outer one
    todo: list[Pending] = session.info.pop(PENDING_KEY, None) or []
    if not todo:
        return
    bind = session.bind
    if isinstance(bind, Connection) and bind.in_transaction():
        # The session joined a transaction it does not own (a test fixture's, a
        # framework's): its commit only released a savepoint, and Core has no
        # after-commit hook. The jobs, recorded unpublished, are left to the relay:
        # published within a relay interval if that transaction commits, never if not.
        return
    for _, fn, _, _ in todo:
        fn()


def _on_soft_rollback(session: Session, ended: Any) -> None:
    _drop_within(session, ended)


def _on_transaction_end(session: Session, ended: Any) -> None:
    if ended.parent is None:
        # The outermost transaction ended without a commit that ran them (a close()
        # without rollback() fires no rollback event): its jobs' rows are gone. A rollback
        # ends it here too, before its after_soft_rollback: one warning either way.
        dropped = _drop_within(session, ended)
        if dropped:
            log.warning(
                "a session's transaction ended without a commit (rolled back or closed): %d "
                "job(s) submitted in it were not committed and will not run: %s",
                len(dropped), ", ".join(f"{job_id} ({stage})" for _, _, job_id, stage in dropped),
            )  # fmt: skip


def _drop_within(session: Session, ended: Any) -> list[Pending]:
    """Forget the pending publishes of ``ended`` and its savepoints; the ones forgotten."""
    pending: list[Pending] | None = session.info.get(PENDING_KEY)
    if not pending:
        return []
    session.info[PENDING_KEY] = [entry for entry in pending if not _within(entry[0], ended)]
    return [entry for entry in pending if _within(entry[0], ended)]


def _within(tx: Any, ancestor: Any) -> bool:
    """Whether session transaction ``tx`` is ``ancestor`` or nested inside it."""
    while tx is not None:
        if tx is ancestor:
            return True
        tx = tx.parent
    return False


__all__ = ["PENDING_KEY", "after_commit", "resolved", "utc_or_none"]
