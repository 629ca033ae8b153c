"""Celery configuration as a pure function of the settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kombu.entity import Exchange, Queue

from conveyor.delivery.transport import NAME as TRANSPORT
from conveyor.settings import ConveyorSettings

JSON_ONLY = ["json"]
PLACEHOLDER_BROKER = "redis://conveyor-not-configured.invalid:6379/0"
# Where a plain Celery app sends a task it has no route for (its ``task_default_queue``).
CELERY_DEFAULT_QUEUE = "celery"


def celery_default_queue() -> Queue:
    """Celery's default queue as a plain Celery app declares it (exchange and routing key
    named like the queue), for workers that consume it (``consume_default_queue``)."""
    name = CELERY_DEFAULT_QUEUE
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def celery_config(
    settings: ConveyorSettings,
    *,
    queues: Sequence[Queue],
    routes: Mapping[str, Mapping[str, Any]] | None = None,
    default_queue: str = "default",
) -> dict[str, Any]:
    """Return the Celery settings for ``settings``. Never reads the environment.

    One visibility timeout is shared by the broker and the result backend, because Celery
    uses the shortest it finds. Everything is JSON: no pickle on the wire or at rest.

    Each choice that costs per job is kept for a guarantee or a feature (costs measured
    by ``bench/throughput.py``, issue #16):

    * ``task_acks_late`` with ``task_reject_on_worker_lost``: a message is acked after its
      job's outcome committed, so a worker killed mid-job loses nothing (at-least-once).
    * ``worker_disable_prefetch`` (multiplier 1): a worker holds at most one unacked message
      per free pool slot, so preemption and a restart never strand a job behind a busy
      slot, and another worker takes what this one cannot start yet.
    * The Redis result backend: ``AsyncResult.get()`` of ``delay()``/``apply_async()``/
      ``send_task``/canvases, and the chord counter. Jobs of ``submit()`` are published
      with Celery's ``ignore_result`` (their outcome is the job row, awaited through
      ``JobHandle.wait``), so they cost the backend nothing unless a chord counts them.
    * ``redis://`` brokers go through :mod:`conveyor.delivery.transport` (kombu's, minus a client
      object built per command).
    * RabbitMQ (``broker_url`` ``amqp://``): publisher confirms, and every publish
      ``mandatory`` (:mod:`conveyor.delivery.amqp`); Redis stays the result backend. Celery uses
      per-consumer prefetch on quorum queues and ignores ``worker_disable_prefetch``, so
      Conveyor's consumer keeps one unacknowledged delivery per pool slot itself
      (:mod:`conveyor.worker.slots`).
    * Task events are off unless ``task_events`` is set: about 0.5 ms of CPU per job in the
      worker's consumer, and the task-sent event a Redis publish per submit. Worker
      heartbeat events stay on, and Flower sends ``enable_events`` to every worker it
      sees, so its task views work without the setting.
    """
    results = settings.redis_url or PLACEHOLDER_BROKER
    broker = settings.resolved_broker_url() or PLACEHOLDER_BROKER
    on_amqp = settings.broker_is_amqp()
    transport: dict[str, Any] = {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": max(1.0, min(60.0, settings.visibility_timeout / 4)),
        # A worker SIGKILLed while holding kombu's restore mutex blocks every restore until
        # the mutex expires (300 s by default); keep that window short.
        "unacked_mutex_expire": max(10.0, min(300.0, settings.visibility_timeout / 4)),
    }
    config: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": results,
        # kombu's AMQP transport takes its options as connection arguments.
        "broker_transport_options": {"confirm_publish": True} if on_amqp else dict(transport),
        "result_backend_transport_options": dict(transport),
        "visibility_timeout": settings.visibility_timeout,
        "broker_connection_retry_on_startup": True,
        # RabbitMQ only (kombu's Redis transport has none): a cut-off worker's deliveries
        # go back to their queues once the broker misses two beats (Celery's default: 120 s).
        "broker_heartbeat": settings.broker_heartbeat,
        # Reconnect for as long as the broker is away: kombu retries forever with None (its
        # `retries >= max_retries` check is skipped), where Celery's default of 100 retries
        # (2 s, 4 s, ... then every 30 s) gives up after about 45 minutes and ends the worker.
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        # A Redis error reply while the consumer runs (e.g. MISCONF or READONLY around a
        # restart or failover) goes through the same reconnect cycle instead of ending it.
        "broker_channel_error_retry": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": JSON_ONLY,
        "result_accept_content": JSON_ONLY,
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        # Celery applies it to Redis only (and warns otherwise); see conveyor.worker.slots.
        "worker_disable_prefetch": not on_amqp,
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        "worker_hijack_root_logger": False,
        # A running job keeps its lease in Postgres through a broker outage and a redelivered
        # copy is refused at claim, so there is nothing to gain from killing it (Celery
        # would, and the job would lose its progress).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_soft_shutdown_timeout": settings.soft_shutdown_timeout,
        "worker_concurrency": settings.worker_concurrency,
        "task_time_limit": settings.default_time_limit,
        "task_soft_time_limit": settings.default_soft_time_limit,
        "result_expires": settings.result_expires,
        "result_extended": False,
        "task_track_started": False,
        "task_create_missing_queues": False,
        "task_queues": list(queues),
        "task_default_queue": default_queue,
        "task_routes": dict(routes or {}),
        "worker_state_db": None,
        "beat_scheduler": "conveyor.upkeep.beat_lock:Scheduler",
        "timezone": "UTC",
        "enable_utc": True,
    }
    if broker.startswith("redis://"):
        # Other schemes (rediss, redis+socket, sentinel) keep kombu's own transport.
        config["broker_transport"] = TRANSPORT
    return config
