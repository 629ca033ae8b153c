"""A Django project that runs stages of its own, in Celery's Django layout::

    # config/celery_app.py (beside config/settings.py)
    import os
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from conveyor.contrib.django.deployment import django_platform
    platform = django_platform("shop")
    app = platform.app

Stages are declared with ``conveyor.shared.stage`` in each installed app's ``tasks.py`` (or
``stages.py``), found as Celery's ``autodiscover_tasks`` finds them; ``conveyor worker``
(``CONVEYOR_APP=config.celery_app``) runs them. This module is the worker's side."""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from kombu.entity import Exchange, Queue

from conveyor.contrib.django import conf
from conveyor.delivery.celeryconfig import celery_config
from conveyor.platform import Platform
from conveyor.worker.step import install

EXCHANGE = Exchange("conveyor", type="direct")  # type: ignore[no-untyped-call]


def django_platform(
    name: str, *, queues: Sequence[str | Queue] | None = None, default_queue: str | None = None
) -> Platform:
    """The Celery app and Conveyor platform of a Django project. Queues come from
    ``queues`` or ``settings.CONVEYOR["QUEUES"]`` (names; default ``["default"]``), the
    database from Django's ``DATABASES`` (``CONVEYOR["DATABASE"]``), the rest as
    :func:`conveyor.contrib.django.conf.conveyor_settings` reads it."""
    conf.use_test_databases()
    settings = conf.conveyor_settings()
    given = conf.options()
    names = list(queues or given.get("QUEUES") or ["default"])
    declared = [
        q if isinstance(q, Queue) else Queue(q, EXCHANGE, routing_key=q)  # type: ignore[no-untyped-call]
        for q in names
    ]
    default = default_queue or given.get("DEFAULT_QUEUE") or declared[0].name
    app = Celery(name)
    app.config_from_object(celery_config(settings, queues=declared, default_queue=default))
    platform = Platform(app, settings, queues=declared, default_queue=default)
    install(platform)
    # Celery's Django fixup sets Django up before these are imported (worker start, or
    # ``conveyor db upgrade`` registering the stages).
    app.autodiscover_tasks()
    app.autodiscover_tasks(related_name="stages")
    return platform


__all__ = ["django_platform"]
