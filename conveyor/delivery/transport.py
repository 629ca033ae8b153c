"""kombu's Redis transport, reusing one client object per channel, and recording a
worker's deliveries in the same round trip as kombu's own bookkeeping.

kombu builds a new ``redis.Redis`` object for every command it sends outside the
consumer's poll (each publish, each delivery's unacked bookkeeping, each ack), and
redis-py's constructor is not cheap: about a tenth of a worker consumer's CPU per job
(issue #16's profile). The object only wraps the channel's connection pool, which hands out
a connection per command, so one object per channel and pool behaves the same.

A worker notes each delivered job in its sorted set of deliveries
(:class:`conveyor.store.liveness.Deliveries`), so the jobs of a worker found dead are sent
again at once. With :func:`record_deliveries` the note joins kombu's transaction that puts
the message in its unacked hash: the delivery and its note are written together, before
the worker sees the message, and the consumer loop waits on one round trip instead of two.
``celery_config`` selects this transport for ``redis://`` broker URLs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

NAME = "conveyor.delivery.transport:Transport"


@dataclass(frozen=True)
class _Record:
    key: str  # the sorted set of this worker's deliveries
    header: str  # the message header naming the job


_record: _Record | None = None


def record_deliveries(key: str | None, header: str = "") -> None:
    """From now on, a message delivered to this process with ``header`` is noted in the
    sorted set ``key`` (member: the header's value, score: the time), in the transaction
    that marks it unacked; None stops it. One worker per process: the setting is global."""
    global _record
    _record = _Record(key, header) if key else None


class QoS(kombu_redis.QoS):
    """kombu's unacked bookkeeping, plus the delivery note of :func:`record_deliveries`."""

    def append(self, message: Any, delivery_tag: Any) -> None:
        """Mark ``message`` unacked (kombu's ZADD and HSET) and note its job, atomically."""
        record = _record
        job_id = (message.headers or {}).get(record.header) if record is not None else None
        if record is None or not job_id:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        delivery = message.delivery_info
        now = time.time()
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: now}).hset(
                self.unacked_key,
                delivery_tag,
                dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),  # type: ignore[no-untyped-call]
            ).zadd(record.key, {str(job_id): now}).execute()
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]


class Channel(kombu_redis.Channel):
    """A kombu Redis channel whose synchronous client is built once per pool."""

    QoS = QoS
    _sync_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """``client`` if given, else this channel's client over its pool."""
        if client:
            yield client
            return
        cached = self._sync_client
        if cached is None or cached.connection_pool is not self.pool:
            cached = self._sync_client = self._create_client()  # type: ignore[no-untyped-call]
        yield cached


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


__all__ = ["NAME", "Channel", "QoS", "Transport", "record_deliveries"]
