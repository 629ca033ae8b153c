"""The "same-config" baseline: ``conveyor.delivery.celeryconfig.celery_config()`` as it was on
2026-11-27 (commit 7d2e024), frozen on purpose.

Issue #16 measures Conveyor against Celery running *this* config. Conveyor may change its
own ``celery_config()`` (that is expected: task events, the result backend, prefetch); this
copy must not follow, or the baseline would move with the thing it measures. Do not edit it
to track conveyor/celeryconfig.py. If a Celery upgrade ever makes a key here invalid, change
only that key and say so in a comment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kombu.entity import Queue

from conveyor.settings import ConveyorSettings

JSON_ONLY = ["json"]
PLACEHOLDER_BROKER = "redis://conveyor-not-configured.invalid:6379/0"


def frozen_celery_config(
    settings: ConveyorSettings,
    *,
    queues: Sequence[Queue],
    routes: Mapping[str, Mapping[str, Any]] | None = None,
    default_queue: str = "default",
) -> dict[str, Any]:
    """Return the Celery settings for ``settings``. Never reads the environment.

    One visibility timeout is shared by the broker and the result backend, because Celery
    uses the shortest it finds. Everything is JSON: no pickle on the wire or at rest.
    """
    broker = settings.redis_url or PLACEHOLDER_BROKER
    transport: dict[str, Any] = {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": max(1.0, min(60.0, settings.visibility_timeout / 4)),
        # A worker SIGKILLed while holding kombu's restore mutex blocks every restore until
        # the mutex expires (300 s by default); keep that window short.
        "unacked_mutex_expire": max(10.0, min(300.0, settings.visibility_timeout / 4)),
    }
    return {
        "broker_url": broker,
        "result_backend": broker,
        "broker_transport_options": dict(transport),
        "result_backend_transport_options": dict(transport),
        "visibility_timeout": settings.visibility_timeout,
        "broker_connection_retry_on_startup": True,
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
        "worker_disable_prefetch": True,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
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
        "beat_scheduler": "celery.beat:Scheduler",
        "timezone": "UTC",
        "enable_utc": True,
    }
