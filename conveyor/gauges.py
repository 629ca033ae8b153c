"""What a worker's metrics endpoint reads at scrape time: the state of the whole deployment
as Postgres and the broker hold it, beside the per-process counters of
:mod:`conveyor.metrics`.

Names follow the Celery exporters' conventions where one exists (``celery-exporter``'s
``celery_queue_length{queue_name}``) and Prometheus base units (seconds). Every worker
that serves metrics reports the same cluster-wide values: aggregate these with ``max``,
not ``sum``. A scrape that cannot reach the database or the broker reports
``conveyor_state_up 0`` and nothing else of its own, never an error page.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import func, select

from conveyor.connections import Connections
from conveyor.db import schema as s
from conveyor.db.dialect import db_now
from conveyor.db.engine import reading
from conveyor.db.schema import dead_letters, job_events, jobs

log = logging.getLogger("conveyor.metrics")

# The statuses of a job not yet finished: each is a gauge value per queue.
LIVE = (s.QUEUED, s.RUNNING, s.RETRYING, s.WAITING_LEASE, s.WAITING_DEDUP, s.THROTTLED)


class StateCollector:
    """A Prometheus collector of queue depths, live jobs, open dead letters and lags."""

    def __init__(self, connections: Connections, queues: Sequence[str]) -> None:
        self.connections = connections
        self.queues = list(queues)

    def describe(self) -> list[Any]:
        """Nothing up front: the registry must not collect (query) when this is registered."""
        return []

    def collect(self) -> Iterator[Any]:
        """The families of one scrape."""
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("conveyor_state_up", "whether the last scrape read the database and broker")
        try:
            families = list(self._families())
        except Exception as exc:
            log.warning("metrics scrape could not read the deployment's state: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        depth = GaugeMetricFamily(
            "conveyor_queue_length", "messages waiting in the broker's queue", labels=["queue_name"]
        )
        for queue, n in sorted(self._queue_lengths().items()):
            depth.add_metric([queue], n)
        live = GaugeMetricFamily(
            "conveyor_jobs", "jobs not yet finished, by queue and status", labels=["queue_name", "status"]
        )
        with reading(self.connections.engine) as conn:
            counts = {
                (str(q), str(st)): int(n)
                for q, st, n in conn.execute(
                    select(jobs.c.queue, jobs.c.status, func.count())
                    .where(jobs.c.status.in_(LIVE))
                    .group_by(jobs.c.queue, jobs.c.status)
                )
            }
            open_entries = conn.execute(
                select(func.count()).select_from(dead_letters).where(dead_letters.c.retried_at.is_(None))
            ).scalar_one()
            now = conn.execute(select(db_now())).scalar_one()
            # Due, recorded, not yet handed to the broker: how far the relay is behind.
            oldest_due = conn.execute(
                select(func.min(jobs.c.run_at)).where(
                    jobs.c.status == s.QUEUED, jobs.c.published_at.is_(None), jobs.c.run_at <= db_now()
                )
            ).scalar_one()
            # Committed, not yet numbered for readers (Postgres only; SQLite numbers nothing).
            oldest_event = (
                conn.execute(
                    select(func.min(job_events.c.created_at)).where(job_events.c.seq.is_(None))
                ).scalar_one()
                if conn.dialect.name == "postgresql"
                else None
            )
        for queue in sorted({q for q, _ in counts} | set(self.queues)):
            for status in LIVE:
                live.add_metric([queue, status], counts.get((queue, status), 0))
        yield depth
        yield live
        dlq = GaugeMetricFamily("conveyor_dead_letters", "dead-letter entries not yet retried")
        dlq.add_metric([], int(open_entries))
        yield dlq
        publish = GaugeMetricFamily(
            "conveyor_publish_lag_seconds", "age of the oldest due job the relay has not yet published"
        )
        publish.add_metric([], _age(now, oldest_due))
        yield publish
        outbox = GaugeMetricFamily(
            "conveyor_outbox_lag_seconds", "age of the oldest committed event readers cannot see yet"
        )
        outbox.add_metric([], _age(now, oldest_event))
        yield outbox


    def _queue_lengths(self) -> dict[str, int]:
        """Messages waiting per queue: the lengths of kombu's Redis lists (one per priority
        step), read with the short-timeout client, so a scrape with Redis away answers in
        about a second instead of waiting out the broker connection's retries."""
        from kombu.transport.redis import PRIORITY_STEPS, Channel

        pipe = self.connections.fast.client().pipeline(transaction=False)
        for queue in self.queues:
            for step in PRIORITY_STEPS:
                pipe.llen(f"{queue}{Channel.sep}{step}" if step else queue)
        lengths = iter(pipe.execute())
        return {queue: sum(int(next(lengths)) for _ in PRIORITY_STEPS) for queue in self.queues}


def _age(now: Any, then: Any) -> float:
    """Seconds from ``then`` to ``now`` (0 without ``then``); naive times are UTC."""
    if then is None:
        return 0.0
    return max(0.0, (_utc(now) - _utc(then)).total_seconds())


def _utc(value: Any) -> dt.datetime:
    assert isinstance(value, dt.datetime)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


__all__ = ["StateCollector"]
