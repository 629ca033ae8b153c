"""The Celery task class of every stage: the claim/complete lifecycle wraps the body."""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from billiard.exceptions import TimeLimitExceeded
from celery import Task
from celery._state import _task_stack
from celery.worker import state as worker_state
from celery.worker.request import Request

from conveyor.client.submit import Submitter
from conveyor.errors import PermanentError, ReplaceRefused, RetryRequested, describe
from conveyor.stage import StageSpec
from conveyor.worker.completion import Completion
from conveyor.worker.runner import Runner


class StageRequest(Request):  # type: ignore[misc]
    """A stage's delivery in the worker's main process: records a hard time limit.

    The pool kills the child at the hard limit with SIGTERM, which the child's body sees
    as a worker-ended job (``is_stopped_by_worker``) and requeues uncounted unless the job
    is already recorded. So the main process records it *before* the kill: billiard runs
    this timeout callback first, then terminates the child. Celery 5.7 also calls
    ``Task.on_failure`` from here, 5.6 does not, so Conveyor relies on neither.
    """

    def on_timeout(self, soft: bool, timeout: float) -> None:
        task = self.task
        if not soft and not worker_state.should_terminate and isinstance(task, StageTask):
            task.completion.record_hard_timeout(task.spec, self.id, TimeLimitExceeded(timeout))
        super().on_timeout(soft, timeout)


class StageTask(Task):  # type: ignore[misc]
    """Base class of every stage: the claim/complete lifecycle wraps the body.

    ``apply_async`` records the job in the database before anything is published, so
    ``delay()``, canvases and ``submit()`` all take the same path. Messages that still
    arrive without a job row (``send_task`` from an app that never imported the stage)
    are adopted at claim time.
    """

    spec: ClassVar[StageSpec]
    runner: ClassVar[Runner]
    submitter: ClassVar[Submitter]
    completion: ClassVar[Completion]
    typing = False
    Request = StageRequest
    acks_late = True
    reject_on_worker_lost = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:
            # As Celery's own __call__: the task is current for the call (``bind=True``).
            _task_stack.push(self)
            try:
                return self.runner.run_inline(self.spec, args, kwargs)
            finally:
                _task_stack.pop()
        return self.runner.execute(self, args, kwargs)

    def replace(self, sig: Any) -> Any:
        """Refused (:class:`conveyor.errors.ReplaceRefused`, the job dead-letters): Celery
        would publish ``sig`` under this task's id, which is this job's id and row."""
        raise ReplaceRefused(
            f"stage {self.name} cannot replace itself (Task.replace): its task id is its job's id "
            "and the job ends in its own row; chain the next stage, or submit it and return its "
            "result (README: Differences from Celery)"
        )

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: dt.datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Another attempt of this job (:class:`conveyor.errors.RetryRequested`), as Celery's
        ``retry``: after ``countdown`` seconds or at ``eta`` (neither: the stage's schedule),
        at most ``max_retries`` retries (not given: the stage's ``max_attempts``), and past
        them the job is dead-lettered with ``exc`` (Celery raises it then too). The payload
        is the job's: other ``args``/``kwargs`` are refused (submit a new job instead)."""
        if args is not None or kwargs is not None:
            raise PermanentError(
                f"stage {self.name}: retry() with other arguments is refused; the job's payload is "
                "stored and retried as it is (submit a new job instead)"
            )
        delay = countdown
        if eta is not None:
            when = eta if eta.tzinfo else eta.replace(tzinfo=dt.UTC)
            delay = (when - dt.datetime.now(dt.UTC)).total_seconds()
        raise RetryRequested(
            f"{self.name} asked to retry" + (f": {describe(exc)}" if exc is not None else ""),
            delay=delay,
            max_attempts=None if max_retries is None else max_retries + 1,
            cause=exc,
        )

    def apply_async(
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Submit as ``submit()`` does (:class:`conveyor.client.submit.Submitter`); countdown/eta become
        ``run_at`` in the database."""
        handle = self.submitter.submit_call(
            self.spec,
            tuple(args or ()),
            dict(kwargs or {}),
            task_id=task_id,
            link=link,
            link_error=link_error,
            options=options,
        )
        result = self.AsyncResult(handle.task_id or handle.id)
        result.job = handle
        return result


__all__ = ["StageTask"]
