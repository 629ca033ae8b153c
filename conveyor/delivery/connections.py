"""This process's connections to the services: the engine, Redis and the broker.

Each is created lazily and belongs to one process: after a fork (a pool child) they are
created again, never shared. Both sides use them, callers and workers alike; the settings
live here too, so :meth:`Connections.bind` changes them for every component at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import psycopg  # noqa: F401  (imported before the pool forks, not once per child)
from celery import Celery
from kombu.entity import Queue
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry
from sqlalchemy import Connection, Engine

from conveyor.delivery.amqp import AmqpEpoch
from conveyor.delivery.broker import Broker, KwargsRepr
from conveyor.delivery.celeryconfig import PLACEHOLDER_BROKER, celery_config
from conveyor.delivery.fastpath import FastPath
from conveyor.delivery.wakeups import Announcer, events_channel
from conveyor.errors import NotRunning
from conveyor.settings import ConveyorSettings
from conveyor.store.db.dialect import is_sqlite
from conveyor.store.db.engine import keepalive_args, make_engine
from conveyor.store.db.lane import Lane
from conveyor.store.events import announce_commits, outbox_committed

# What ``celery_config`` derives from the service URLs (the rest of the app's config stays).
BROKER_KEYS = (
    "broker_url",
    "broker_transport",
    "broker_transport_options",
    "result_backend",
    "worker_disable_prefetch",
)


class Connections:
    """The engine, Redis client and broker of one Celery app, per process."""

    def __init__(
        self, app: Celery, settings: ConveyorSettings, queues: Sequence[Queue], *, direct: bool = False
    ) -> None:
        self.app = app
        self.direct = direct  # a client's: see Broker
        self.settings = settings
        self.queues = list(queues)
        self._engine: Engine | None = None
        self._redis: Redis | None = None
        self._broker: Broker | None = None
        # A stage's own kwargsrepr by name (Broker.kwargsrepr_for): kept here, as the broker
        # is made again in a forked child.
        self.kwargsrepr_for: Callable[[str], KwargsRepr | None] = lambda stage: None
        self._lane: Lane | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Redis on the submit path: short timeouts and a breaker (submit needs Postgres only).
        self.fast = FastPath(
            lambda: self.settings.redis_url,
            timeout=settings.submit_redis_timeout,
            cooldown=settings.submit_redis_cooldown,
        )

    def bind(self, *, redis_url: str, database_url: str, broker_url: str | None = None) -> None:
        """Point the connections (and the Celery app) at concrete services (``broker_url``:
        RabbitMQ's; None: Redis is the broker)."""
        self.settings = self.settings.with_urls(redis_url, database_url).model_copy(
            update={"broker_url": broker_url}
        )
        broker = self.settings.resolved_broker_url()
        if broker != self.app.conf.broker_url:
            # Celery keeps its producer pool for the life of the app: connections to the old
            # broker must not serve publishes meant for the new one. The pools are kombu's,
            # shared per URL (and found again on a bind back): dropped here, never closed.
            self.app._pool = None
            self.app.amqp._producer_pool = None
        fresh = celery_config(self.settings, queues=self.queues)
        self.app.conf.update({key: fresh.get(key) for key in BROKER_KEYS})
        self.reset()

    def reset(self) -> None:
        """Forget connections (after fork, or after :meth:`bind`)."""
        if self._lane is not None and os.getpid() == self._pid:
            self._lane.close()  # this thread's kept connection, back to the pool it came from
        if self._engine is not None:
            self._engine.dispose(close=os.getpid() == self._pid)
        self._engine = None
        self._redis = None
        self._broker = None
        self._lane = None
        self.fast.reset()
        self._pid = os.getpid()

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            self.reset()

    @property
    def engine(self) -> Engine:
        """This process's SQLAlchemy engine (bounded pool)."""
        self._check_pid()
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    url = self.settings.database_url
                    if not url:
                        raise NotRunning(
                            "no database configured: run `conveyor up` or set CONVEYOR_DATABASE_URL"
                        )
                    self._engine = make_engine(
                        url,
                        pool_size=self.settings.db_pool_size,
                        connect_timeout=self.settings.db_connect_timeout,
                        schema=self.settings.db_schema,
                        keepalives=keepalive_args(
                            self.settings.db_keepalives_idle,
                            self.settings.db_keepalives_interval,
                            self.settings.db_keepalives_count,
                        ),
                    )
                    announce_commits(
                        self._engine, Announcer(self._wake_url, events_channel(self.settings.key_prefix))
                    )
        return self._engine

    def _wake_url(self) -> str | None:
        url = self.settings.redis_url
        return None if not url or url == PLACEHOLDER_BROKER else url

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A connection for single-statement writes: autocommit on Postgres (one round
        trip); on SQLite an ordinary transaction (its writers must BEGIN IMMEDIATE)."""
        if is_sqlite(self.engine):
            with self.engine.begin() as conn:
                yield conn
            return
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    @property
    def lane(self) -> Lane | None:
        """The claim and completion statements on Postgres, below SQLAlchemy's execution
        layer (:mod:`conveyor.store.db.lane`); None on SQLite."""
        engine = self.engine
        if self._lane is None or self._lane.engine is not engine:
            if is_sqlite(engine):
                return None
            self._lane = Lane(engine, self.settings.db_schema, announce=lambda: outbox_committed(engine))
        return self._lane

    @property
    def redis(self) -> Redis:
        """This process's Redis client (for Conveyor's own keys)."""
        self._check_pid()
        if self._redis is None:
            url = self.settings.redis_url
            if not url or url == PLACEHOLDER_BROKER:
                raise NotRunning("no Redis configured: run `conveyor up` or set CONVEYOR_REDIS_URL")
            self._redis = Redis.from_url(url, health_check_interval=30, socket_timeout=30)
        return self._redis

    def redis_answers(self, timeout: float = 2.0) -> bool:
        """Whether Conveyor's own Redis answers a PING within ``timeout`` seconds now (a
        client of its own: the shared one may wait out a long socket timeout)."""
        url = self.settings.redis_url
        if not url or url == PLACEHOLDER_BROKER:
            return False
        probe = Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        try:
            return bool(probe.ping())
        except RedisError:
            return False
        finally:
            probe.close()

    @property
    def broker(self) -> Broker:
        """Publisher and epoch keeper."""
        self._check_pid()
        if self._broker is None:
            self._broker = Broker(
                self.app,
                self.redis,
                self.queues,
                self.settings.key_prefix,
                fast=self.fast,
                direct=self.direct,
                amqp_epoch=(
                    AmqpEpoch(self.settings.key_prefix, lambda: self.engine)
                    if self.settings.broker_is_amqp()
                    else None
                ),
            )
            self._broker.kwargsrepr_for = lambda stage: self.kwargsrepr_for(stage)
        return self._broker


__all__ = ["Connections"]
