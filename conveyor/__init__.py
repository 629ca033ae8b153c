"""Conveyor: a Celery platform where every job is accounted for in the database.

Postgres (or the embedded SQLite) is the source of truth; Redis only delivers. An app
calls it through :func:`connect` (:class:`Client`, or :class:`AsyncClient` for asyncio),
by stage name, with no stage code; a deployment declares stages with
``conveyor.shared.stage`` and builds its ``Platform`` (:mod:`conveyor.platform`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    Cancelled,
    ConfigurationError,
    ConveyorError,
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
    from conveyor.client import Client, connect
    from conveyor.client_async import AsyncClient
    from conveyor.shared import current_platform

# Imported on first use: ``import conveyor.errors`` (every module does) stays light.
_LAZY = {
    "Client": "conveyor.client",
    "connect": "conveyor.client",
    "AsyncClient": "conveyor.client_async",
    "current_platform": "conveyor.shared",
}


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
    "current_platform",
]
