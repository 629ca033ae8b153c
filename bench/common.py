"""What every benchmark shares: private services, the platform, progress on stderr."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from redis import Redis

if TYPE_CHECKING:
    from conveyor.platform import Platform

DEFAULT_REDIS = "redis://127.0.0.1:6379"
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432"


class BenchError(RuntimeError):
    """The benchmark could not produce a valid measurement."""


def log(message: str) -> None:
    """Human progress, on stderr (stdout carries only the name=value lines)."""
    print(message, file=sys.stderr, flush=True)


def add_service_args(parser: argparse.ArgumentParser, *, redis_db: int, database: str) -> None:
    """``--redis``, ``--pg``, ``--redis-db`` and ``--database``, with this bench's defaults."""
    parser.add_argument("--redis", default=DEFAULT_REDIS, help="Redis base URL, without a DB index")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--redis-db", type=int, default=redis_db, help="Redis DB index (flushed)")
    parser.add_argument("--database", default=database, help="Postgres database (dropped and created)")


def recreate_database(pg: str, name: str, *, create: bool = True) -> None:
    """Drop (and by default create again) the bench database."""
    import psycopg

    with psycopg.connect(f"{pg.rstrip('/')}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            conn.execute(f'CREATE DATABASE "{name}"')


@dataclass
class Services:
    """A flushed Redis DB, a fresh database, a temporary home."""

    redis_url: str
    database_url: str
    home: Path
    redis: Redis
    pg: str
    database: str

    def release(self) -> None:
        """Drop the bench database and empty its Redis DB."""
        recreate_database(self.pg, self.database, create=False)
        self.redis.flushdb()
        self.redis.close()


def prepare(args: argparse.Namespace, *, prefix: str) -> Services:
    """Flush/create the bench's own services and point the settings at them.

    Settings are read when ``config.celery_app`` is imported, so this must run first.
    """
    redis_url = f"{args.redis.rstrip('/')}/{args.redis_db}"
    database_url = f"{args.pg.rstrip('/')}/{args.database}"
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["CONVEYOR_REDIS_URL"] = redis_url
    os.environ["CONVEYOR_DATABASE_URL"] = database_url
    os.environ["CONVEYOR_HOME"] = str(home)
    redis = Redis.from_url(redis_url)
    redis.flushdb()
    recreate_database(args.pg, args.database)
    return Services(redis_url, database_url, home, redis, args.pg, args.database)


def open_platform() -> Platform:
    """The deployment's platform, stages imported, schema migrated."""
    from config.celery_app import platform
    from config.migrations import upgrade

    platform.app.loader.import_default_modules()
    upgrade(platform.engine)
    return platform
