"""Celery's ``t/integration/tasks.py`` under its own name, for one side of the comparison.

Installed by :mod:`tests.upstream.canvas_suite` as ``t/integration/tasks.py``, beside the
unchanged upstream file (``celery_tasks.py``). On the ``plain`` side the upstream source
runs as it is. On the ``stages`` side each ``@shared_task`` function becomes a Conveyor
stage of the same name, declared on its plain signature (``bind=True`` kept: the body gets
its task as ``self``), with one attempt as a Celery task without ``autoretry_for`` has
(``self.retry()`` asks for more). Either way the tasks' Redis is the session's own DB.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import celery
from redis import StrictRedis
from t.integration import sides

# Celery's options that a stage has as its own policy; the rest only tune Celery.
_LIMITS = ("time_limit", "soft_time_limit")


def _stage_from(fn: Callable[..., Any], options: dict[str, Any]) -> Any:
    name = options.get("name") or f"{__name__}.{fn.__name__}"
    limits = {k: options[k] for k in _LIMITS if options.get(k)}
    if limits.get("soft_time_limit", 0) >= limits.get("time_limit", float("inf")):
        limits.pop("soft_time_limit")  # Celery refuses it at call time; the stage keeps its own
    return sides.platform.stage(
        name, queue=sides.QUEUE, max_attempts=1, bind=bool(options.get("bind")), **limits
    )(fn)


def _as_stages(*args: Any, **options: Any) -> Any:
    """``shared_task``'s two forms: ``@shared_task`` and ``@shared_task(**options)``."""
    if len(args) == 1 and callable(args[0]) and not options:
        return _stage_from(args[0], {})
    return lambda fn: _stage_from(fn, options)


def _run_upstream() -> None:
    source = Path(__file__).with_name("celery_tasks.py")
    code = compile(source.read_text(), str(source), "exec")
    if sides.SIDE == "stages":
        plain_shared_task = celery.shared_task
        celery.shared_task = _as_stages  # only while the upstream module body runs
        try:
            exec(code, globals())
        finally:
            celery.shared_task = plain_shared_task
    else:
        exec(code, globals())


_run_upstream()


def get_redis_connection() -> StrictRedis:  # type: ignore[type-arg]  # replaces upstream's (localhost, DB 0)
    """The Redis the upstream tasks and tests write to: this session's own DB."""
    return StrictRedis.from_url(sides.TASKS_REDIS_URL, socket_timeout=None)
