"""Self-check stages: used by ``conveyor demo``, the tests and the benchmark."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Literal

import psycopg
import sqlalchemy as sa
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_success
from pydantic import BaseModel, ConfigDict
from redis import Redis
from sqlalchemy.pool import NullPool

from conveyor.context import JobContext
from conveyor.dedup import Dedup
from conveyor.errors import PermanentError, TransientError
from conveyor.retry import Schedule
from conveyor.shared import current_platform, stage
from tasks.demo.logic import is_fixed, mark, record_effect, square

FAST_RETRY = Schedule((0.2, 0.5, 1.0))
_kill_after_commit_of: set[str] = set()


class Number(BaseModel):
    """A number to square."""

    model_config = ConfigDict(extra="ignore")
    n: int


class Flaky(BaseModel):
    """Fails transiently on the first ``fail_times`` attempts."""

    n: int
    fail_times: int = 1


class Effect(BaseModel):
    """Writes one effect row; the other fields are kill points for the fault tests."""

    model_config = ConfigDict(extra="ignore")
    note: str | None = None
    barrier: str | None = None
    barrier_timeout: float = 60.0
    sleep: float = 0.0
    crash_until_attempt: int = 0
    kill_worker_after_commit: bool = False
    ignore_soft_limit: bool = False
    write_first: bool = False  # write the effect row before sleeping (holds SQLite's writer)
    checkpoint: bool = False  # checkpoint once past the barrier (a cancel there stops the job)


class Keyed(Effect):
    """An effect keyed by user: at most one pending per user (simple dedup)."""

    user: str


class Pad(BaseModel):
    """Carries (and returns) ``n`` bytes of padding: the payload-size tests' stage."""

    n: int = 0
    pad: str = ""


@stage("conveyor.demo.pad", payload=Pad, queue="demo")
def pad(ctx: JobContext, p: Pad) -> dict[str, Any]:
    """Return ``n`` bytes of padding (which the next link of a chain receives)."""
    return {"pad": "x" * p.n, "n": 0}


@stage("conveyor.demo.noop", payload=Number, queue="demo")
def noop(ctx: JobContext, p: Number) -> dict[str, int]:
    """Do nothing but succeed (the benchmark's stage)."""
    return {"n": p.n}


@stage("conveyor.demo.logged", payload=Number, queue="demo")
def logged(ctx: JobContext, p: Number) -> dict[str, int]:
    """Log one line through ``ctx.log`` and pass ``n`` on (the tracing tests' stage)."""
    ctx.log.warning("logged %s", p.n)
    return {"n": p.n}


@stage("conveyor.demo.square", payload=Number, queue="demo", label=lambda p: f"square {p.n}")
def square_stage(ctx: JobContext, p: Number) -> dict[str, int]:
    """Square ``n`` (chains pass the result on as ``n``)."""
    return {"n": square(p.n)}


@stage("conveyor.demo.flaky", payload=Flaky, queue="demo", retry=FAST_RETRY, max_attempts=4)
def flaky(ctx: JobContext, p: Flaky) -> dict[str, int]:
    """Raise a transient error until the attempt number passes ``fail_times``."""
    if ctx.attempt <= p.fail_times:
        raise TransientError(f"simulated transient fault on attempt {ctx.attempt}")
    return {"n": p.n, "attempts": ctx.attempt}


@stage("conveyor.demo.broken", payload=Number, queue="demo", label=lambda p: f"broken {p.n}")
def broken(ctx: JobContext, p: Number) -> None:
    """Always fail permanently, with a message a person can act on."""
    raise PermanentError(f"record {p.n} cannot be processed: the input is known bad (self-check)")


class Fixable(BaseModel):
    """Fails until its cause is fixed (:func:`tasks.demo.logic.fix`)."""

    key: str


@stage("conveyor.demo.fixable", payload=Fixable, queue="demo", label=lambda p: f"fixable {p.key}")
def fixable(ctx: JobContext, p: Fixable) -> dict[str, str]:
    """Fail permanently until an effect row says ``key`` is fixed: a dead letter to retry
    once its cause is gone (the console's test)."""
    if not is_fixed(ctx.connection, p.key):
        raise PermanentError(f"{p.key} is broken: fix its cause, then retry it from the dead letters")
    return {"key": p.key}


@stage("conveyor.demo.effect", payload=Effect, queue="demo", retry=FAST_RETRY, max_attempts=4)
def effect(ctx: JobContext, p: Effect) -> dict[str, Any]:
    """Write an effect row through the job's transaction (exactly-once with completion).

    With ``barrier`` set it first pushes ``job:attempt:pid`` to ``<barrier>:started`` and
    blocks until something is pushed to ``<barrier>:go``: tests kill processes there.
    """
    if p.barrier:
        r = current_platform().redis
        r.rpush(f"{p.barrier}:started", f"{ctx.job_id}:{ctx.attempt}:{os.getpid()}")
        r.blpop([f"{p.barrier}:go"], timeout=p.barrier_timeout)
    if p.checkpoint:
        ctx.checkpoint()
    if ctx.attempt <= p.crash_until_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    if p.write_first:
        record_effect(ctx.connection, job_id=ctx.job_id, stage=ctx.stage, attempt=ctx.attempt, note=p.note)
    deadline = time.monotonic() + p.sleep
    while time.monotonic() < deadline:
        try:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        except SoftTimeLimitExceeded:
            if not p.ignore_soft_limit:
                raise
    if not p.write_first:
        record_effect(ctx.connection, job_id=ctx.job_id, stage=ctx.stage, attempt=ctx.attempt, note=p.note)
    if p.kill_worker_after_commit:
        _kill_after_commit_of.add(ctx.job_id)
    return {"job_id": ctx.job_id}


@task_success.connect(weak=False)
def _kill_after_commit(sender: Any = None, result: Any = None, **_: Any) -> None:
    """Kill point for the fault tests: the completion has committed, the ack has not."""
    if getattr(sender, "name", None) != effect.name or not isinstance(result, dict):
        return
    if result.get("job_id") in _kill_after_commit_of:  # only after the body ran, not on a replay
        os.killpg(os.getpgid(0), signal.SIGKILL)


@stage(
    "conveyor.demo.keyed",
    payload=Keyed,
    queue="demo",
    dedup=Dedup(mode="simple", key="user:{user}"),
    label=lambda p: f"keyed {p.user}",
)
def keyed(ctx: JobContext, p: Keyed) -> dict[str, Any]:
    """The effect stage with simple dedup per user."""
    return effect.spec.fn(ctx, p)  # type: ignore[no-any-return]


class Sync(BaseModel):
    """A long, preemptable per-user sync: loops over records, checkpointing every ``every``."""

    user: str
    note: str
    records: int = 10_000
    every: int = 10
    per_record: float = 0.0
    ignore_checkpoints_on_first_attempt: bool = False
    # The stopped body's cleanup write takes this long, after a `<note>:cleaning:<attempt>`
    # marker: tests deliver a late interrupt into it.
    cleanup_hold: float = 0.0


class Write(BaseModel):
    """A short, high-priority per-user write that preempts a running sync."""

    user: str
    note: str


@stage(
    "conveyor.demo.sync",
    payload=Sync,
    queue="demo",
    lease_key="user:{user}",
    priority=0,
    preemptable=True,
    label=lambda p: f"sync {p.user}",
)
def sync(ctx: JobContext, p: Sync) -> dict[str, Any]:
    """Writes ``<note>:start:<attempt>`` when it starts and ``<note>:cleanup:<attempt>`` if
    it is stopped (its ``finally`` runs even when interrupted by the escalation signal)."""
    ignore = p.ignore_checkpoints_on_first_attempt and ctx.attempt == 1
    finished = False
    try:
        # Inside the try: an interrupt landing just after the start marker commits (while
        # its connection is returned) must still write the cleanup marker.
        mark(
            current_platform().engine,
            job_id=ctx.job_id,
            stage=ctx.stage,
            attempt=ctx.attempt,
            note=f"{p.note}:start:{ctx.attempt}",
        )
        for i in range(p.records):
            if p.per_record:
                time.sleep(p.per_record)
            if not ignore and i % p.every == 0:
                ctx.checkpoint()
        finished = True
    finally:
        if not finished:
            engine = current_platform().engine
            if p.cleanup_hold:
                mark(
                    engine,
                    job_id=ctx.job_id,
                    stage=ctx.stage,
                    attempt=ctx.attempt,
                    note=f"{p.note}:cleaning:{ctx.attempt}",
                )
            mark(
                engine,
                job_id=ctx.job_id,
                stage=ctx.stage,
                attempt=ctx.attempt,
                note=f"{p.note}:cleanup:{ctx.attempt}",
                hold=p.cleanup_hold,
            )
    record_effect(
        ctx.connection, job_id=ctx.job_id, stage=ctx.stage, attempt=ctx.attempt, note=f"{p.note}:done"
    )
    return {"records": p.records}


@stage(
    "conveyor.demo.write",
    payload=Write,
    queue="priority",
    lease_key="user:{user}",
    priority=10,
    label=lambda p: f"write {p.user}",
)
def write(ctx: JobContext, p: Write) -> dict[str, str]:
    """Marks ``<note>:start`` as soon as it holds the user's lease."""
    mark(
        current_platform().engine,
        job_id=ctx.job_id,
        stage=ctx.stage,
        attempt=ctx.attempt,
        note=f"{p.note}:start",
    )
    return {"user": p.user}


class Query(BaseModel):
    """A database failure inside a body, for the error-policy tests (``kind`` picks it)."""

    kind: Literal[
        "statement_timeout", "syntax", "data", "disconnect", "nul", "params", "unique", "ok",
        "downstream_sqlalchemy", "downstream_psycopg", "downstream_redis",
    ]  # fmt: skip
    fail_until_attempt: int = 99
    url: str = ""  # the body's own server of the downstream_* kinds


QUERIES = {
    "statement_timeout": "SET LOCAL statement_timeout = 50; SELECT pg_sleep(1)",
    "syntax": "SELEC 1",
    "data": "SELECT CAST('not a number' AS integer)",
    "disconnect": "SELECT pg_terminate_backend(pg_backend_pid())",
    "unique": "DO $$ BEGIN RAISE unique_violation; END $$",
}
# Statements psycopg itself refuses before sending them (sqlstate None).
CLIENT_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "nul": ("SELECT %s::text", ("a\x00b",)),
    "params": ("SELECT %s", (1, 2)),
}


def _downstream(kind: str, url: str) -> None:
    """Connect to a server of the body's own (not Conveyor's), as a stage would."""
    if kind == "downstream_sqlalchemy":
        engine = sa.create_engine(url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        finally:
            engine.dispose()
    elif kind == "downstream_psycopg":
        psycopg.connect(url, connect_timeout=2).close()
    else:
        Redis.from_url(url, socket_connect_timeout=2).ping()


@stage("conveyor.demo.query", payload=Query, queue="demo", retry=FAST_RETRY, max_attempts=2)
def query(ctx: JobContext, p: Query) -> dict[str, Any]:
    """Run a query that fails the way ``kind`` says until ``fail_until_attempt``."""
    counted = ctx.attempt
    if p.kind != "ok" and counted <= p.fail_until_attempt:
        if p.kind.startswith("downstream_"):
            _downstream(p.kind, p.url)
        elif p.kind in CLIENT_REFUSED:
            ctx.connection.exec_driver_sql(*CLIENT_REFUSED[p.kind])
        else:
            ctx.connection.exec_driver_sql(QUERIES[p.kind])
    return {"attempt": counted}
