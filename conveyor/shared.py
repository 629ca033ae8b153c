"""Stages declared without naming a platform, and the platform of this process.

A deployment's stage modules write ``@conveyor.stage("conveyor.files.extract", ...)``
instead of importing the deployment's app module: each declaration is bound to every
platform, the ones that exist and the ones created later, the way Celery's
``shared_task`` binds a task to every app. So stage code never needs
``from config.celery_app import platform``, and an app that uses only the client never
imports stage code at all.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from celery import current_app
from celery.local import Proxy

from conveyor.errors import ConfigurationError

_lock = threading.Lock()
_declared: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
_platforms: weakref.WeakSet[Any] = weakref.WeakSet()
_newest: list[weakref.ref[Any]] = []
# The attempt running in this thread (or task): the runner sets it around every body.
_job: contextvars.ContextVar[Any] = contextvars.ContextVar("conveyor_job")


def stage(name: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare ``fn(ctx, payload)`` as stage ``name`` on every platform (the options are
    those of :meth:`conveyor.platform.Platform.stage`); without ``payload=``, ``fn`` is an
    ordinary function (``def add(x, y)``) whose parameters are the payload's fields, and
    its job is :func:`current_job`.

    Returns a proxy to the task of the current platform, so ``extract.s(...)`` and
    ``extract.delay(...)`` work as on a task.
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        with _lock:
            _declared[name] = (fn, dict(options))
            platforms = list(_platforms)
        for platform in platforms:
            platform.stage(name, **options)(fn)
        return Proxy(lambda: current_platform().app.tasks[name])

    return decorate


def attach(platform: Any) -> None:
    """Bind every shared stage declared so far to ``platform`` (and the later ones too)."""
    with _lock:
        _platforms.add(platform)
        _newest[:] = [weakref.ref(platform)]
        declared = list(_declared.items())
    for name, (fn, options) in declared:
        platform.stage(name, **options)(fn)


def current_job() -> Any:
    """The :class:`conveyor.worker.context.JobContext` of the attempt running in this
    thread: what a stage declared on a plain signature has instead of a ``ctx`` parameter.
    Raises ``LookupError`` outside a stage body."""
    try:
        return _job.get()
    except LookupError:
        raise LookupError("no job is running here: current_job() is for a stage's body") from None


@contextmanager
def job_scope(ctx: Any) -> Iterator[None]:
    """Make ``ctx`` the :func:`current_job` while a body runs (the runner's)."""
    token = _job.set(ctx)
    try:
        yield
    finally:
        _job.reset(token)


def current_platform() -> Any:
    """The platform of this process: the current Celery app's (a worker sets its app
    current), else the one created last."""
    platform = getattr(cast(Any, current_app)._get_current_object(), "conveyor", None)
    if platform is None and _newest:
        platform = _newest[0]()
    if platform is None:
        raise ConfigurationError(
            "no Conveyor platform in this process: import the deployment's app module first "
            "(CONVEYOR_APP, e.g. config.celery_app), or call conveyor.connect() to submit by name"
        )
    return platform


__all__ = ["attach", "current_job", "current_platform", "job_scope", "stage"]
