"""Conveyor: a Celery platform where every job is accounted for in the database.

Postgres (or the embedded SQLite) is the source of truth; Redis only delivers. See
``Platform`` for declaring stages and submitting jobs.
"""

from conveyor.errors import (
    Cancelled,
    ConfigurationError,
    ConveyorError,
    PayloadInvalid,
    PermanentError,
    Preempted,
    TransientError,
)
from conveyor.retry import Backoff, Schedule
from conveyor.shared import current_platform

__all__ = [
    "Backoff",
    "Cancelled",
    "ConfigurationError",
    "ConveyorError",
    "PayloadInvalid",
    "PermanentError",
    "Preempted",
    "Schedule",
    "TransientError",
    "current_platform",
]
