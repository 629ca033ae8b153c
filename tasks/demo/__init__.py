"""Self-check stages: used by ``conveyor demo``, the tests and the benchmark."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from config.celery_app import platform
from conveyor.context import JobContext
from conveyor.errors import PermanentError, TransientError
from conveyor.retry import Schedule
from tasks.demo.logic import record_effect, square

FAST_RETRY = Schedule((0.2, 0.5, 1.0))


class Number(BaseModel):
    """A number to square."""

    model_config = ConfigDict(extra="ignore")
    n: int


class Flaky(BaseModel):
    """Fails transiently on the first ``fail_times`` attempts."""

    n: int
    fail_times: int = 1


class Effect(BaseModel):
    """Writes one effect row; optionally waits on a Redis barrier first."""

    model_config = ConfigDict(extra="ignore")
    note: str | None = None
    barrier: str | None = None
    barrier_timeout: float = 60.0
    sleep: float = 0.0
    crash: bool = False


@platform.stage("conveyor.demo.noop", payload=Number, queue="demo")
def noop(ctx: JobContext, p: Number) -> dict[str, int]:
    """Do nothing but succeed (the benchmark's stage)."""
    return {"n": p.n}


@platform.stage("conveyor.demo.square", payload=Number, queue="demo", label=lambda p: f"square {p.n}")
def square_stage(ctx: JobContext, p: Number) -> dict[str, int]:
    """Square ``n`` (chains pass the result on as ``n``)."""
    return {"n": square(p.n)}


@platform.stage("conveyor.demo.flaky", payload=Flaky, queue="demo", retry=FAST_RETRY, max_attempts=4)
def flaky(ctx: JobContext, p: Flaky) -> dict[str, int]:
    """Raise a transient error until the attempt number passes ``fail_times``."""
    if ctx.attempt <= p.fail_times:
        raise TransientError(f"simulated transient fault on attempt {ctx.attempt}")
    return {"n": p.n, "attempts": ctx.attempt}


@platform.stage("conveyor.demo.broken", payload=Number, queue="demo", label=lambda p: f"broken {p.n}")
def broken(ctx: JobContext, p: Number) -> None:
    """Always fail permanently, with a message a person can act on."""
    raise PermanentError(f"record {p.n} cannot be processed: the input is known bad (self-check)")


@platform.stage("conveyor.demo.effect", payload=Effect, queue="demo", retry=FAST_RETRY, max_attempts=4)
def effect(ctx: JobContext, p: Effect) -> dict[str, str]:
    """Write an effect row through the job's transaction (exactly-once with completion).

    With ``barrier`` set it first announces ``<barrier>:started`` and blocks until
    something is pushed to ``<barrier>:go``: tests kill workers at that point.
    """
    if p.barrier:
        r = platform.redis
        r.rpush(f"{p.barrier}:started", f"{ctx.job_id}:{ctx.attempt}")
        r.blpop([f"{p.barrier}:go"], timeout=p.barrier_timeout)
    if p.sleep:
        time.sleep(p.sleep)
    if p.crash:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    record_effect(ctx.connection, job_id=ctx.job_id, stage=ctx.stage, attempt=ctx.attempt, note=p.note)
    return {"job_id": ctx.job_id}
