"""RabbitMQ as Celery's broker: the broker epoch kept where the messages are, publishes
that count only once a queue took them, and at most one unacknowledged delivery per pool
slot.

*The epoch.* With Redis as the broker, the epoch key lives beside the messages, so a wiped
Redis loses both and the relay republishes what was published under the old epoch. With
RabbitMQ the messages survive a Redis wipe, so the epoch must not depend on Redis: it is a
durable quorum queue named after it (``<prefix>epoch.<hex>``, holding no message), recorded
in Postgres (``conveyor_counters``) and cached in Redis. Redis wiped: the value is read from
Postgres and the marker queue found, nothing is republished. The broker's data lost (a node
reset, a new cluster): the marker is gone, a new epoch is made and everything published
under the old one is sent again (claims refuse the copies of jobs that ran).

*Publishes.* Publisher confirms (``confirm_publish``) alone also ack a message that no
queue took (a deleted queue, a missing binding), so every publish is ``mandatory`` and a
returned message is a failed publish: the relay publishes the job again.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kombu.entity import Exchange, Queue
from sqlalchemy import Engine, select, update

from conveyor.store.db.dialect import upsert
from conveyor.store.db.schema import counters

log = logging.getLogger("conveyor.amqp")

QUORUM = {"x-queue-type": "quorum"}
EPOCH_COUNTER = "broker_epoch"
# RabbitMQ's epochs are told apart from Redis's (plain hex): a process whose broker is not
# the workers' sees it in the epoch and leaves its jobs to the relay (conveyor.delivery.broker).
EPOCH_PREFIX = "amqp-"


class Unroutable(ConnectionError):
    """The broker confirmed a publish that no queue took (returned as unroutable)."""


def quorum_queue(name: str, exchange: Exchange | None = None, routing_key: str | None = None) -> Queue:
    """A durable quorum queue (on Redis the arguments are ignored)."""
    return Queue(  # type: ignore[no-untyped-call]
        name,
        exchange if exchange is not None else Exchange(""),  # type: ignore[no-untyped-call]
        routing_key=routing_key or name,
        durable=True,
        queue_arguments=dict(QUORUM),
    )


class Returns:
    """The ``basic.return`` handler of one channel: notes the correlation id (Celery's task
    id) of each returned message, so the publisher can fail the publish once its confirm
    arrives (the return comes first). Registering a handler also keeps py-amqp from raising
    inside its wait for the confirm, which would leave that confirm to the next publish."""

    def __init__(self) -> None:
        self.returned: set[str] = set()

    def __call__(self, exc: Any, exchange: Any, routing_key: Any, message: Any) -> None:
        """py-amqp's callback: remember the returned message's id."""
        properties = getattr(message, "properties", None) or {}
        self.returned.add(str(properties.get("correlation_id")))
        log.warning("broker returned a message for %r: no queue took it (%s)", routing_key, exc)

    def take(self, task_id: str) -> bool:
        """Whether the message of ``task_id`` was returned (forgetting it)."""
        if task_id in self.returned:
            self.returned.discard(task_id)
            return True
        return False


def returns_of(producer: Any) -> Returns | None:
    """The :class:`Returns` of ``producer``'s channel, registered on first use; None when
    the transport is not AMQP (Redis has no returns)."""
    channel = producer.channel
    events = getattr(channel, "events", None)
    if events is None or not hasattr(channel, "basic_publish_confirm"):
        return None
    handler = getattr(channel, "_conveyor_returns", None)
    if handler is None:
        handler = Returns()
        events["basic_return"].add(handler)
        channel._conveyor_returns = handler
    return handler


@contextlib.contextmanager
def taken_by_queues(producer: Any, task_ids: Sequence[str]) -> Iterator[None]:
    """Around the confirmed publishes of ``task_ids`` (none: nothing checked): raise
    :class:`Unroutable` afterwards if the broker returned any of them."""
    handler = returns_of(producer) if task_ids else None
    yield
    if handler is None:
        return
    lost = [t for t in task_ids if handler.take(t)]
    if lost:
        raise Unroutable(f"{len(lost)} message(s) reached no queue (deleted queue or missing binding)")


def _ready(connection: Any, name: str) -> int | None:
    """Ready messages in queue ``name``, None if it does not exist; on a channel of its
    own (a failed passive declare closes the channel it ran on)."""
    channel = connection.channel()
    try:
        return int(channel.queue_declare(queue=name, passive=True).message_count)
    except connection.channel_errors:
        return None
    finally:
        with contextlib.suppress(Exception):
            channel.close()


def queue_exists(connection: Any, name: str) -> bool:
    """Whether queue ``name`` exists."""
    return _ready(connection, name) is not None


def message_counts(connection: Any, names: Sequence[str]) -> dict[str, int]:
    """Ready messages per queue (0 for a queue that does not exist)."""
    return {name: _ready(connection, name) or 0 for name in names}


class AmqpEpoch:
    """The broker epoch of a RabbitMQ broker (see the module's docstring)."""

    def __init__(self, key_prefix: str, engine: Callable[[], Engine]) -> None:
        self.prefix = key_prefix
        self.engine = engine

    def marker(self, epoch: str) -> Queue:
        """The (empty) quorum queue whose existence says the broker still has ``epoch``."""
        return quorum_queue(f"{self.prefix}epoch.{epoch}")

    def stored(self) -> str | None:
        """The epoch recorded in Postgres, if any."""
        with self.engine().connect() as conn:
            value = conn.execute(select(counters.c.value).where(counters.c.name == EPOCH_COUNTER)).scalar()
        return None if value is None else _hex(int(value))

    def current(self, connection: Any, cached: str | None, declare_all: Callable[[Any], None]) -> str:
        """The broker's epoch: ``cached`` if its marker queue exists, else the one Postgres
        recorded if its marker exists, else a new one (every queue declared first)."""
        if cached is not None and not cached.startswith(EPOCH_PREFIX):
            cached = None  # Redis was the broker before: its epoch says nothing here
        if cached is not None and queue_exists(connection, self.marker(cached).name):
            return cached
        stored = self.stored()
        if stored is not None and stored != cached and queue_exists(connection, self.marker(stored).name):
            return stored
        declare_all(connection)
        fresh = _hex(secrets.randbits(62))
        channel = connection.default_channel
        self.marker(fresh).bind(channel).declare()  # type: ignore[no-untyped-call]
        winner = self._swap(stored, fresh)
        if winner != fresh:  # another process made one at the same time: theirs stands
            with contextlib.suppress(Exception):
                self.marker(fresh).bind(connection.channel()).delete()  # type: ignore[no-untyped-call]
        else:
            log.warning("new broker epoch %s: jobs published before it are published again", fresh)
        return winner

    def _swap(self, expected: str | None, fresh: str) -> str:
        """Record ``fresh`` if Postgres still holds ``expected``; the recorded epoch."""
        value = _int(fresh)
        with self.engine().begin() as conn:
            if expected is None:
                stmt = upsert(conn, counters).values(name=EPOCH_COUNTER, value=value)
                conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            else:
                conn.execute(
                    update(counters)
                    .where(counters.c.name == EPOCH_COUNTER, counters.c.value == _int(expected))
                    .values(value=value)
                )
            now = conn.execute(select(counters.c.value).where(counters.c.name == EPOCH_COUNTER)).scalar_one()
        return _hex(int(now))


def _hex(value: int) -> str:
    return f"{EPOCH_PREFIX}{value:016x}"


def _int(epoch: str) -> int:
    return int(epoch.removeprefix(EPOCH_PREFIX), 16)


__all__ = [
    "EPOCH_PREFIX",
    "QUORUM",
    "AmqpEpoch",
    "Returns",
    "Unroutable",
    "message_counts",
    "queue_exists",
    "quorum_queue",
    "returns_of",
    "taken_by_queues",
]
