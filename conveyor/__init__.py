"""Conveyor: a Celery platform where every job is accounted for in the database.

Postgres (or the embedded SQLite) is the source of truth; Redis only delivers. An app
calls it through :func:`connect` (:class:`Client`, or :class:`AsyncClient` for asyncio),
by stage name, with no stage code; a deployment declares stages with
``conveyor.shared.stage`` and builds its ``Platform`` (:mod:`conveyor.platform`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    Cancelled,
    ConfigurationError,
    ConveyorError,
    Deferred,
    IdempotencyConflict,
    JobIdInvalid,
    OwnerInvalid,
    PayloadInvalid,
    PayloadTooLarge,
    PermanentError,
    Preempted,
    SubmitFailed,
    TaskIdRefused,
    TransientError,
    UnknownStage,
)
from conveyor.retry import Backoff, Schedule

if TYPE_CHECKING:
    from conveyor.client.by_name import Client
    from conveyor.client.by_name_async import AsyncClient
    from conveyor.settings import ConveyorSettings
    from conveyor.shared import current_job, current_platform

# Imported on first use: ``import conveyor.errors`` (every module does) stays light.
_LAZY = {
    "Client": "conveyor.client.by_name",
    "AsyncClient": "conveyor.client.by_name_async",
    "current_platform": "conveyor.shared",
    "current_job": "conveyor.shared",
}


def connect(
    settings: ConveyorSettings | None = None,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    broker_url: str | None = None,
) -> Client:
    """A :class:`Client` for the deployment named by ``settings``; without them, in a Django
    project that configures Conveyor, by ``settings.CONVEYOR`` and ``DATABASES`` (as
    :mod:`conveyor.contrib.django`), else by the environment (``CONVEYOR_DATABASE_URL``, ...).
    The URLs given replace the settings'; ``broker_url``: the workers' RabbitMQ, if any."""
    from conveyor.client.by_name import Client

    base = settings if settings is not None else _site_settings()
    return Client(base, database_url=database_url, redis_url=redis_url, broker_url=broker_url)


def _site_settings() -> ConveyorSettings | None:
    """The Django project's settings for Conveyor, when this process runs one; else None."""
    # A Django site has imported Django before it calls Conveyor (manage.py, wsgi.py, and
    # Celery's Django fix-up when DJANGO_SETTINGS_MODULE is set): any other process is
    # spared importing it.
    if "django" not in sys.modules:
        return None
    from conveyor.contrib.django.conf import site_settings

    return site_settings()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "Backoff",
    "Cancelled",
    "Client",
    "ConfigurationError",
    "ConveyorError",
    "Deferred",
    "IdempotencyConflict",
    "JobIdInvalid",
    "OwnerInvalid",
    "PayloadInvalid",
    "PayloadTooLarge",
    "PermanentError",
    "Preempted",
    "Schedule",
    "SubmitFailed",
    "TaskIdRefused",
    "TransientError",
    "UnknownStage",
    "connect",
    "current_job",
    "current_platform",
]
