"""Periodic jobs. Beat publishes through the stages' ``apply_async``, so every firing is a
tracked job; Conveyor's relay and reconciler run inside the workers, not here."""

from __future__ import annotations

from typing import Any

from celery.schedules import crontab

BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "self-check-heartbeat": {
        "task": "conveyor.demo.noop",
        "schedule": 300.0,
        "kwargs": {"n": 0},
        "options": {"expires": 240},
    },
    # Completes sealed batches whose chord counter was lost (Postgres owns completion),
    # sweeps dead uploads and what dead chunk attempts staged.
    "files-reconcile": {"task": "conveyor.files.reconcile", "schedule": 60.0, "options": {"expires": 50}},
    # The trading family's weekly digests: Mondays 00:05 UTC, last ISO week, one digest per
    # user with trades or a connection (each deduplicated by user and period: a second
    # firing, or a beat that fires twice, adds nothing).
    "trading-weekly-digests": {
        "task": "conveyor.trading.digest_fanout",
        "schedule": crontab(minute="5", hour="0", day_of_week="mon"),
        "kwargs": {"week": None},
        "options": {"expires": 6 * 3600},
    },
}
