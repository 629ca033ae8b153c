"""The deployment's state as Postgres and the broker hold it now: what a worker's metrics
endpoint reads at scrape time (:class:`StateCollector`, beside the per-process counters of
:mod:`conveyor.metrics`) and what ``conveyor top`` shows (:func:`read_state`).

Metric names follow the Celery exporters' conventions where one exists (``celery-exporter``'s
``celery_queue_length{queue_name}``) and Prometheus base units (seconds). Every worker
that serves metrics reports the same cluster-wide values: aggregate these with ``max``,
not ``sum``. A scrape that cannot reach the database or the broker reports
``conveyor_state_up 0`` and what it could read (nothing of the broker's when the broker
is away), never an error page.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import RowMapping

from conveyor.delivery.connections import Connections
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import dead_letters, job_events, jobs

log = logging.getLogger("conveyor.metrics")

# The statuses of a job not yet finished: each is a gauge value per queue.
LIVE = (s.QUEUED, s.RUNNING, s.RETRYING, s.WAITING_LEASE, s.WAITING_DEDUP, s.THROTTLED)


@dataclass
class State:
    """One reading of the deployment's state."""

    queue_lengths: dict[str, int]  # messages waiting in the broker, per queue
    live: dict[tuple[str, str], int]  # jobs not finished, per (queue, status)
    dead_letters: int  # open entries
    publish_lag: float  # seconds: the oldest due job the relay has not yet published
    outbox_lag: float  # seconds: the oldest committed event readers cannot see yet
    broker_up: bool = True  # False: the broker did not answer (no queue lengths)
    finished: dict[str, int] = field(default_factory=dict)  # per status, within ``window``
    running: list[RowMapping] = field(default_factory=list)  # the longest-running jobs
    window: float = 60.0

    def queues(self) -> list[str]:
        """Every queue this reading knows of."""
        return sorted(set(self.queue_lengths) | {q for q, _ in self.live})


def read_state(
    connections: Connections, queues: Sequence[str], *, running: int = 0, window: float = 60.0
) -> State:
    """The state now: ``queues``' broker lengths, live jobs, open dead letters, lags; with
    ``running``, that many running jobs (oldest first) and the jobs finished within the
    last ``window`` seconds per status."""
    try:
        lengths, broker_up = queue_lengths(connections, queues), True
    except Exception as exc:
        log.debug("queue lengths unavailable: %s", type(exc).__name__)
        lengths, broker_up = {}, False
    with reading(connections.engine) as conn:
        live = {
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
        state = State(
            lengths, live, int(open_entries), _age(now, oldest_due), _age(now, oldest_event), broker_up
        )
        if running:
            state.window = window
            state.finished = {
                str(st): int(n)
                for st, n in conn.execute(
                    select(jobs.c.status, func.count())
                    .where(jobs.c.finished_at >= db_now_plus(-window))
                    .group_by(jobs.c.status)
                )
            }
            state.running = list(
                conn.execute(
                    select(
                        jobs.c.id,
                        jobs.c.stage,
                        jobs.c.queue,
                        jobs.c.label,
                        jobs.c.attempts,
                        jobs.c.lease_owner,
                        jobs.c.started_at,
                        jobs.c.progress,
                    )
                    .where(jobs.c.status == s.RUNNING)
                    .order_by(jobs.c.started_at)
                    .limit(running)
                ).mappings()
            )
    return state


def queue_lengths(connections: Connections, queues: Sequence[str]) -> dict[str, int]:
    """Messages waiting per queue: the lengths of kombu's Redis lists (one per priority
    step), read with the short-timeout client, so a reading with Redis away fails in about
    a second instead of waiting out the broker connection's retries. On RabbitMQ, each
    queue's ready messages (a passive declare)."""
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    if connections.settings.broker_is_amqp():
        return connections.broker.message_counts(queues)

    pipe = connections.fast.client().pipeline(transaction=False)
    for queue in queues:
        for step in PRIORITY_STEPS:
            pipe.llen(f"{queue}{Channel.sep}{step}" if step else queue)
    lengths = iter(pipe.execute())
    return {queue: sum(int(next(lengths)) for _ in PRIORITY_STEPS) for queue in queues}


class StateCollector:
    """A Prometheus collector of :func:`read_state`, read at each scrape."""

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
            state = read_state(self.connections, self.queues)
        except Exception as exc:
            log.warning("metrics scrape could not read the deployment's state: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1 if state.broker_up else 0)
        yield up
        depth = GaugeMetricFamily(
            "conveyor_queue_length", "messages waiting in the broker's queue", labels=["queue_name"]
        )
        for queue, n in sorted(state.queue_lengths.items()):
            depth.add_metric([queue], n)
        yield depth
        live = GaugeMetricFamily(
            "conveyor_jobs", "jobs not yet finished, by queue and status", labels=["queue_name", "status"]
        )
        for queue in state.queues():
            for status in LIVE:
                live.add_metric([queue, status], state.live.get((queue, status), 0))
        yield live
        for name, help_text, number in (
            ("conveyor_dead_letters", "dead-letter entries not yet retried", state.dead_letters),
            (
                "conveyor_publish_lag_seconds",
                "age of the oldest due job the relay has not yet published",
                state.publish_lag,
            ),
            (
                "conveyor_outbox_lag_seconds",
                "age of the oldest committed event readers cannot see yet",
                state.outbox_lag,
            ),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], number)
            yield gauge


def _age(now: Any, then: Any) -> float:
    """Seconds from ``then`` to ``now`` (0 without ``then``); naive times are UTC."""
    if then is None:
        return 0.0
    return max(0.0, (_utc(now) - _utc(then)).total_seconds())


def _utc(value: Any) -> dt.datetime:
    assert isinstance(value, dt.datetime)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


__all__ = ["LIVE", "State", "StateCollector", "queue_lengths", "read_state"]
