"""Conveyor's one error hierarchy. The class of an error decides what happens to the job.

::

    ConveyorError
     ├── TransientError            retried with the stage's backoff until max attempts
     │    ├── InfrastructureError  Postgres/Redis unreachable around a claim: the message is
     │    │                        requeued after a backoff and no attempt is counted
     │    └── LeaseLost            the job was taken over (stale lease); the late writer's
     │                             transaction is rolled back (the fencing check failed)
     ├── PermanentError            dead-lettered at once, never retried
     │    ├── PayloadInvalid       the payload does not match the stage's model
     │    └── GarbageMessage       a message no stage can run (unknown name, undecodable body,
     │         │                   forbidden content type); recorded with headers, never body
     │         └── TaskIdRefused   a plain Celery message whose task id cannot be its job's id
     ├── Interrupted               the job stops early at a checkpoint; not a failure
     │    ├── Preempted            a higher-priority job needs the lease: requeued, no attempt
     │    └── Cancelled            cancel() was called: the job ends ``cancelled``
     ├── Deferred                  the body must wait (a peer's rate limit): the job is parked
     │                             ``seconds``, its attempt uncounted, up to ``max_deferred``
     ├── SkipJob                   the body found nothing to do (e.g. its record moved on): the
     │                             job ends ``skipped`` with a result, and the flow continues
     ├── ConfigurationError        a stage or setting that cannot work (e.g. hard time limit
     │    │                        not below the visibility timeout); raised at start-up
     │    └── UnknownStage         a client named a stage the stage registry does not hold;
     │                             the message lists close names
     ├── NotRunning                a command needs ``conveyor up`` (or URLs) and found neither
     ├── OwnerInvalid              an owner name that is not a plain name (letters, digits, ._@+-)
     ├── JobIdInvalid              a job_id at submit that cannot be a job's id
     ├── IdempotencyConflict       a submit naming an existing job of a strict stage that is
     │                             not the same request (another stage or payload)
     ├── ScopeInvalid              a token scope that is not read, submit or admin
     └── SubmitFailed              submit could not record the job: its database failed (an
                                   outage, a timeout). Redis never fails a submit

Any other exception raised by a stage body counts as transient: an unknown failure is
retried, because giving up on a job that might have succeeded on a second try is the
worse mistake. Stages that know better raise :class:`PermanentError`.

Database errors are classified by what they mean, not by the driver's class names: a
*lost connection* (:func:`is_connection_loss`) of Conveyor's own Postgres or Redis
(:func:`is_own_outage`) never counts an attempt; a statement the driver or the database
refused as wrong (``DataError``, ``ProgrammingError``, ``IntegrityError``, raised by the
server or by the driver itself) is permanent; anything else a query raises (a statement
timeout, a deadlock, a serialization failure, a lock timeout) is an ordinary transient
failure that counts, and so is an outage of a server the body itself connects to.
Uncounted requeues are bounded too (``max_requeues``): past the bound the job is
dead-lettered with "infrastructure kept failing".
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

# Redis and SQLAlchemy are imported by the functions that need them: every module imports
# this one, and `import conveyor` (or `conveyor --help`) must not load them.
if TYPE_CHECKING:
    import sqlalchemy.exc


class ConveyorError(Exception):
    """Root of every error Conveyor raises on purpose."""


class TransientError(ConveyorError):
    """A failure that may go away: the job is retried with backoff."""


class InfrastructureError(TransientError):
    """Postgres or Redis could not be reached; never counts as an attempt."""


class WorkerLost(TransientError):
    """The worker running an attempt died (crash, OOM, kill) or stopped heartbeating."""


class LeaseLost(TransientError):
    """This attempt no longer owns the job (fencing token or lease check failed)."""


class RetryRequested(TransientError):
    """A stage body asked for another attempt (Celery's ``Task.retry``): the attempt counts,
    the next one runs after ``delay`` seconds (``None``: the stage's schedule), and no more
    than ``max_attempts`` counted attempts run in all (``None``: the stage's own budget).
    ``cause`` is the error the body gave (``retry(exc=...)``), if any."""

    def __init__(
        self,
        message: str,
        *,
        delay: float | None = None,
        max_attempts: int | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.delay = delay
        self.max_attempts = max_attempts
        self.cause = cause


class PermanentError(ConveyorError):
    """A failure that retrying cannot fix: the job goes straight to the DLQ."""


class PayloadInvalid(PermanentError):
    """The payload failed the stage's model validation. ``problems``, when the check knows
    them (a client's JSON Schema check), holds one ``field: what is wrong`` line each."""

    def __init__(self, message: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class ReplaceRefused(PermanentError):
    """A stage body called ``Task.replace``: a job is its own row under its task id and
    ends there, so another signature cannot take that id over (README, Differences from
    Celery)."""


class GarbageMessage(PermanentError):
    """A broker message that no stage can run."""


class TaskIdRefused(GarbageMessage):
    """A message sent without a job (``send_task`` by name) whose task id cannot be its
    job's id: longer than a job id, or already the id of a job of another stage
    (``taken_by``, that job's stage)."""

    def __init__(self, message: str, *, taken_by: str | None = None) -> None:
        super().__init__(message)
        self.taken_by = taken_by


class Interrupted(ConveyorError):
    """Raised at a checkpoint to stop a running job without failing it."""


class Preempted(Interrupted):
    """A job of higher priority needs this job's lease."""


class Cancelled(Interrupted):
    """The job was cancelled by a user or the platform."""


class Deferred(ConveyorError):
    """Raised by a stage body: stop this attempt and run the job again in ``seconds``
    (a peer's ``Retry-After``, a rate-limit window's reset). The job is parked
    ``throttled`` until then, its lease released, the attempt uncounted (not a requeue
    either), with a ``job.deferred {seconds, reason}`` event. The stage's ``max_deferred``
    bounds the seconds a job may spend deferred in all; past it, the deferral counts as
    an ordinary transient failure. ``reason`` is for people: name the peer, never a secret."""

    def __init__(self, seconds: float, reason: str) -> None:
        super().__init__(f"deferred {seconds:.3f}s: {reason}")
        self.seconds = max(0.0, float(seconds))
        self.reason = reason


class SkipJob(ConveyorError):
    """Raised by a stage body: end this job ``skipped`` (not failed) and pass ``result`` on."""

    def __init__(self, reason: str, result: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result


class ConfigurationError(ConveyorError):
    """A stage declaration or setting that cannot work."""


class UnknownStage(ConfigurationError):
    """A stage name the stage registry (the ``stages`` table) does not hold. ``name`` is
    the name asked for, ``suggestions`` the registered names close to it (maybe none)."""

    def __init__(self, message: str, *, name: str, suggestions: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.suggestions = suggestions


class NotRunning(ConveyorError):
    """No services are configured and ``conveyor up`` is not running."""


class OwnerInvalid(ConveyorError, ValueError):
    """An owner name (of a token, or ``owner=`` at submit) that is not 1-64 letters, digits
    and ``._@+-``, starting with a letter or digit. Raised before anything is written."""


class JobIdInvalid(ConveyorError, ValueError):
    """A ``job_id`` given at submit that is not 1-36 letters, digits and ``-_.``. Raised
    before anything is written."""


class ScopeInvalid(ConveyorError, ValueError):
    """A token scope that is not ``read``, ``submit`` or ``admin`` (or no scope at all)."""


class SubmitFailed(ConveyorError):
    """A submit could not record its job because the database failed (unreachable, timed
    out, refused). The one error a caller catches around ``submit`` for an outage: the job
    may or may not have committed if the connection died during the commit, so retry with
    the same ``idempotency_key``. Redis being away never raises it: the relay publishes
    the job when Redis is back."""


class IdempotencyConflict(ConveyorError, ValueError):
    """A submit that names an existing job (by ``job_id`` or idempotency key) of a stage
    declared ``idempotency="strict"``, but is not the same request: another stage, or
    another payload (the stage's ``idempotency_ignore`` fields left out). Nothing was
    recorded; ``job_id`` is the existing job's id (HTTP 409 ``idempotency-conflict``)."""

    def __init__(self, message: str, *, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class DatabaseBusy(InfrastructureError):
    """SQLite's single writer is held by another transaction longer than a caller that
    must not queue behind it (a heartbeat, the relay) is willing to wait."""


class RetryRefused(ConveyorError):
    """A DLQ retry whose job a submit would now deduplicate into the job holding its dedup
    id (``holder``), or (:class:`RetryNeedsDeployment`) one a client may not perform."""

    def __init__(self, message: str, *, holder: str | None) -> None:
        super().__init__(message)
        self.holder = holder


class RetryNeedsDeployment(RetryRefused):
    """A DLQ retry asked of a client (the HTTP API) for a stage that has, or may have, an
    ``on_retry`` hook: only the deployment's code can run it (``conveyor dlq retry``)."""

    def __init__(self, message: str, *, entry_id: int | None = None) -> None:
        super().__init__(message, holder=None)
        self.entry_id = entry_id


class PayloadTooLarge(PayloadInvalid):
    """A payload whose JSON is over the ``max_payload_bytes`` setting."""


class RequeuesExhausted(InfrastructureError):
    """A job was requeued uncounted (outages, shutdowns) more often than ``max_requeues``."""


def _connection_loss() -> tuple[type[BaseException], ...]:
    import redis.exceptions
    import sqlalchemy.exc

    # SQLAlchemy's pool timing out means our own database is saturated or gone: no attempt.
    return (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        sqlalchemy.exc.TimeoutError,
        InfrastructureError,
    )


# billiard's pool child turns SIGTERM into SystemExit(-(256 - SIGTERM)): the worker (a
# cold shutdown, or Celery cancelling jobs on a broker connection loss) stopped the job.
STOPPED_BY_WORKER = -(256 - signal.SIGTERM)


def is_connection_loss(exc: BaseException) -> bool:
    """True when ``exc`` means a Postgres or Redis could not be reached, whose ever it is
    (:func:`is_own_outage` tells whether it was Conveyor's own: only that is uncounted).

    A DBAPI error counts as a lost connection only when SQLAlchemy invalidated the
    connection (``connection_invalidated``) or the server never answered: query-level
    failures that psycopg also files under ``OperationalError`` (statement timeout,
    deadlock, lock timeout), a statement psycopg refuses itself (a NUL byte, a wrong
    parameter count: ``sqlstate`` None too) and SQLite's "no such table" are not outages.
    """
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return bool(exc.connection_invalidated) or _unreachable(exc)
    return isinstance(exc, _connection_loss())


# Set on an exception raised by Conveyor's own engine or its pool (mark_own).
_OWN = "_conveyor_own"


def mark_own(exc: BaseException) -> BaseException:
    """Note that Conveyor's own engine or pool raised ``exc`` (see
    :func:`conveyor.store.db.engine.make_engine`); returns it."""
    setattr(exc, _OWN, True)
    return exc


def is_own_outage(exc: BaseException, *, redis_answers: Callable[[], bool]) -> bool:
    """True when ``exc``, raised while a stage body ran, is a lost connection of
    Conveyor's own: its engine (or pool) raised it, or it is a Redis connection error and
    Conveyor's own Redis does not answer either (``redis_answers``, asked only then).

    The same errors from a server the body itself connects to (its own engine, psycopg or
    Redis client) are the body's: counted, and retried on the stage's policy.
    """
    if isinstance(exc, InfrastructureError):
        return True
    if not is_connection_loss(exc):
        return False
    if getattr(exc, _OWN, False):
        return True
    import redis.exceptions

    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return not redis_answers()
    return False


# SQLSTATE classes that mean "no usable connection": connection exceptions, and a server
# shutting down, crashed or still starting.
_UNREACHABLE_STATES = ("08", "57P01", "57P02", "57P03")
# SQLite: the database file is busy or locked by another writer past the busy timeout.
_SQLITE_BUSY = ("database is locked", "database table is locked")


def _unreachable(exc: sqlalchemy.exc.DBAPIError) -> bool:
    import sqlalchemy.exc

    orig = exc.orig
    if orig is None:
        return False
    if hasattr(orig, "sqlstate"):
        state = orig.sqlstate
        if state is None:
            # psycopg: the server never answered (OperationalError), or psycopg refused the
            # statement itself before sending it (DataError, ProgrammingError, ...).
            return isinstance(exc, sqlalchemy.exc.OperationalError)
        return str(state).startswith(_UNREACHABLE_STATES)
    text = str(orig)
    return any(phrase in text for phrase in _SQLITE_BUSY)


_REFUSED_STATEMENT = ("DataError", "ProgrammingError", "IntegrityError")


def _driver_errors(names: Sequence[str]) -> tuple[type[BaseException], ...]:
    """The DBAPI classes ``names`` of the drivers loaded in this process (an exception of a
    driver never imported cannot exist here: nothing is imported for the check)."""
    found: list[type[BaseException]] = []
    for module in ("psycopg", "sqlite3"):
        driver = sys.modules.get(module)
        if driver is not None:
            found.extend(getattr(driver, name) for name in names)
    return tuple(found)


def is_stopped_by_worker(exc: BaseException) -> bool:
    """True when the worker itself ended this job (shutdown, broker outage): uncounted."""
    return isinstance(exc, SystemExit) and exc.code == STOPPED_BY_WORKER


def is_permanent(exc: BaseException) -> bool:
    """Return True when ``exc`` must dead-letter the job without a retry.

    A statement the database or the driver rejected as malformed, invalid for its data or
    breaking a constraint fails the same way every time, through SQLAlchemy or raw psycopg;
    other database errors (timeouts, deadlocks) may pass.
    """
    import sqlalchemy.exc

    refused = (sqlalchemy.exc.DataError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.IntegrityError)
    return isinstance(exc, (PermanentError, *refused, *_driver_errors(_REFUSED_STATEMENT)))


def describe(exc: BaseException) -> str:
    """A person-facing message for ``exc``: for a database error, the driver's own words
    (first line only), never the statement or its parameters."""
    import sqlalchemy.exc

    orig: BaseException | None = exc
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        orig = exc.orig
    elif not isinstance(exc, _driver_errors(("Error",))):
        orig = None
    if orig is not None:
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        return f"database error ({type(orig).__name__}): {first}"
    return str(exc).strip() or type(exc).__name__


class OutOfBounds(PermanentError):
    """Work run by :func:`conveyor.worker.isolate.run_bounded` outgrew its memory or time bound.

    Permanent: the same input exceeds the same bound again. ``reason`` says which bound;
    ``bound`` is that bound in bytes (memory) or seconds (time).
    """

    def __init__(self, reason: Literal["memory", "time"], bound: float) -> None:
        if reason == "memory":
            message = f"exceeded its memory bound of {bound / (1 << 20):g} MiB"
        else:
            message = f"did not finish within {bound:g} s"
        super().__init__(message)
        self.reason: Literal["memory", "time"] = reason
        self.bound = bound


class ChildFailed(PermanentError):
    """A function run by :func:`conveyor.worker.isolate.run_bounded` raised something that is not
    a :class:`ConveyorError` (or its child died oddly). A deterministic function failing
    on the same input fails again, so this is permanent. ``type_name`` is the original
    exception's qualified class name (or e.g. ``"signal"``), ``detail`` its message."""

    def __init__(self, type_name: str, detail: str) -> None:
        super().__init__(f"{type_name}: {detail}" if detail else type_name)
        self.type_name = type_name
        self.detail = detail
