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
     │                             forbidden content type); recorded with headers, never body
     ├── Interrupted               the job stops early at a checkpoint; not a failure
     │    ├── Preempted            a higher-priority job needs the lease: requeued, no attempt
     │    └── Cancelled            cancel() was called: the job ends ``cancelled``
     ├── SkipJob                   the body found nothing to do (e.g. its record moved on): the
     │                             job ends ``skipped`` with a result, and the flow continues
     ├── ConfigurationError        a stage or setting that cannot work (e.g. hard time limit
     │                             not below the visibility timeout); raised at start-up
     └── NotRunning                a command needs ``conveyor up`` (or URLs) and found neither

Any other exception raised by a stage body counts as transient: an unknown failure is
retried, because giving up on a job that might have succeeded on a second try is the
worse mistake. Stages that know better raise :class:`PermanentError`.
"""

from __future__ import annotations


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


class PermanentError(ConveyorError):
    """A failure that retrying cannot fix: the job goes straight to the DLQ."""


class PayloadInvalid(PermanentError):
    """The payload failed the stage's model validation."""


class GarbageMessage(PermanentError):
    """A broker message that no stage can run."""


class Interrupted(ConveyorError):
    """Raised at a checkpoint to stop a running job without failing it."""


class Preempted(Interrupted):
    """A job of higher priority needs this job's lease."""


class Cancelled(Interrupted):
    """The job was cancelled by a user or the platform."""


class SkipJob(ConveyorError):
    """Raised by a stage body: end this job ``skipped`` (not failed) and pass ``result`` on."""

    def __init__(self, reason: str, result: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result


class ConfigurationError(ConveyorError):
    """A stage declaration or setting that cannot work."""


class NotRunning(ConveyorError):
    """No services are configured and ``conveyor up`` is not running."""


def is_permanent(exc: BaseException) -> bool:
    """Return True when ``exc`` must dead-letter the job without a retry."""
    return isinstance(exc, PermanentError)
