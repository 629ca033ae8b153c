"""The caller's own transaction, for frameworks whose transactions are not SQLAlchemy
sessions (Django's ``atomic()``): where a submit writes its row, and how its publish waits
for the commit. A SQLAlchemy ``Session`` is accepted as it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from sqlalchemy import Connection


@runtime_checkable
class Enlistment(Protocol):
    """A transaction a job joins: its row commits, or rolls back, with the caller's rows."""

    def connection(self) -> Connection:
        """A SQLAlchemy connection inside the caller's transaction; the caller's framework
        ends that transaction, never Conveyor."""
        ...

    def after_commit(self, fn: Callable[[], None], job_id: str) -> None:
        """Run ``fn`` (the publish) once the outermost transaction commits; never if the
        transaction, or a savepoint around the submit, rolls back. The job's row is
        recorded unpublished: if ``fn`` never runs after a commit (a crash, a framework
        that skipped it), the relay's next pass publishes job ``job_id``."""
        ...
