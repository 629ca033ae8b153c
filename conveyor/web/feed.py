"""The event feed's reads: pages of the outbox (``job_events``) in commit order, filtered
and scoped to an owner, with a cursor that resumes after them.

Positions are gap-free in commit order (:mod:`conveyor.store.events`), so a page read up to the
outbox's head lets a filtered reader's cursor jump to that head: a reader of one sparse
owner or job does not scan the same unrelated events again on its next read.

An event's owner is its job's (``jobs.owner``). An event of no job or of a job of no
owner (the deployment's own, such as the files family's ``batch.*`` and ``file.*``) is
the owner's its body names (``owner``); one naming none only an admin (no owner filter)
sees.
A batch is not Conveyor's notion (batches belong to a deployment, such as the files
family): ``batch`` matches events whose body carries that ``batch_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Engine,
    RowMapping,
    Select,
    String,
    func,
    literal_column,
    select,
)

from conveyor.store.db.engine import reading
from conveyor.store.db.schema import job_events, jobs
from conveyor.store.events import event_position, resolve_cursor, sequence_events
from conveyor.store.jobs import parse_cursor


class CursorAhead(ValueError):
    """A cursor past the newest event: this feed never gave it out (its database was
    replaced or restored since), so reading on from it would silently skip what comes."""


@dataclass(frozen=True)
class FeedFilter:
    """Which events a reader wants; None matches any. ``owner`` keeps only the events of
    that owner's jobs (a non-admin reader always has its own here)."""

    job: str | None = None
    flow: str | None = None
    batch: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class FeedPage:
    """Events after a cursor, the cursor after them, and whether the page was full (more
    may be waiting: read again at once)."""

    rows: list[RowMapping]
    cursor: str
    full: bool


def check_cursor(cursor: str | None) -> None:
    """Raise ValueError unless ``cursor`` is a cursor of the feed (or None)."""
    parse_cursor(cursor)


def read_page(engine: Engine, since: str | None, where: FeedFilter, limit: int) -> FeedPage:
    """Up to ``limit`` events matching ``where`` after cursor ``since`` (None: the
    beginning), in commit order. Every event committed before the call is either here or
    before ``since``; one committed later comes in a later page. Raises ValueError for a
    malformed cursor, :class:`CursorAhead` for one past the newest event. Blocking: call
    it from a thread in async code."""
    parsed = parse_cursor(since)
    with reading(engine) as conn:
        sequence_events(conn)
        after = resolve_cursor(conn, parsed)
        position = event_position(conn)
        head = conn.execute(select(func.max(position))).scalar()
        if after > (head or 0):
            raise CursorAhead(f"the cursor {after} is past the newest event ({head or 0})")
        if head is None or head <= after:
            return FeedPage([], str(after), False)
        dialect = conn.dialect.name
        q = select(job_events, position.label("position")).where(position > after, position <= head)
        if where.flow is not None:
            q = q.join(jobs, jobs.c.id == job_events.c.job_id).where(jobs.c.flow_id == where.flow)
            if where.owner is not None:
                q = q.where(jobs.c.owner == where.owner)
        elif where.owner is not None:
            q = owned_by(q, dialect, where.owner)
        if where.job is not None:
            q = q.where(job_events.c.job_id == where.job)
        if where.batch is not None:
            q = q.where(body_field(dialect, "batch_id") == where.batch)
        if where.owner is not None and dialect == "postgresql":
            # Its estimate counts a probe of jobs per event of the range (see owned_by):
            # over jit_above_cost Postgres would compile the plan first, 0.2 s on a range
            # of 100k events, several times what the probes cost.
            conn.exec_driver_sql("SET LOCAL jit = off")
        rows = list(conn.execute(q.order_by(position).limit(limit)).mappings())
    if len(rows) == limit:
        return FeedPage(rows, str(rows[-1]["position"]), True)
    return FeedPage(rows, str(head), False)


def owned_by(q: Select[Any], dialect: str, owner: str) -> Select[Any]:
    """``q`` (over ``job_events``) kept to the events of ``owner``: its jobs' events, and
    those of no job or of a job of no owner (the deployment's own, such as a batch's and
    its files' stages) whose body names it.

    The job's owner is a correlated lookup by primary key, not a join: the reader walks
    the outbox in position order and stops at its page, probing ``jobs`` per event, where
    an outer join let the planner hash the whole ``jobs`` table on every read (issue #16,
    ``tests/integration/test_hot_path_plans.py``)."""
    job_owner = select(jobs.c.owner).where(jobs.c.id == job_events.c.job_id).scalar_subquery()
    return q.where(func.coalesce(job_owner, body_field(dialect, "owner")) == owner)


def head_cursor(engine: Engine) -> str:
    """The cursor of the outbox's head: a reader starting there sees only later events."""
    with reading(engine) as conn:
        sequence_events(conn)
        head = conn.execute(select(func.max(event_position(conn)))).scalar()
    return str(head or 0)


def body_field(dialect: str, name: str) -> ColumnElement[Any]:
    """A text field of an event's body (``batch_id`` written as migration 0014 indexes it)."""
    assert name.isidentifier()
    body = job_events.c.body
    if dialect == "sqlite":
        return func.json_extract(body, literal_column(f"'$.{name}'"), type_=String)
    return body.op("->>", return_type=String)(literal_column(f"'{name}'"))


__all__ = [
    "CursorAhead",
    "FeedFilter",
    "FeedPage",
    "body_field",
    "check_cursor",
    "head_cursor",
    "owned_by",
    "read_page",
]
