"""The one Celery app: ``celery -A config.celery_app worker``."""

from __future__ import annotations

import logging

from celery import Celery

from config import HAS_EMAIL, HAS_FILES, HAS_PUBLISHER, HAS_TRADING
from config.beat import BEAT_SCHEDULE
from config.queues import DEFAULT_QUEUE, QUEUES
from config.settings import get_settings
from conveyor.delivery.celeryconfig import celery_config
from conveyor.delivery.services import attach
from conveyor.platform import Platform
from conveyor.worker.step import install

# A family whose extra is not installed is left out (config/__init__.py), and says so.
_FAMILIES = {"files": HAS_FILES, "email": HAS_EMAIL, "publisher": HAS_PUBLISHER, "trading": HAS_TRADING}
for _family, _installed in _FAMILIES.items():
    if not _installed:
        logging.getLogger("conveyor").warning(
            "the %s family is off: install conveyor[%s] to run it", _family, _family
        )

TASK_MODULES = [
    "tasks.demo",
    *(["tasks.files.stages"] if HAS_FILES else []),
    *(["tasks.email.stages"] if HAS_EMAIL else []),
    *(["tasks.publisher.stages"] if HAS_PUBLISHER else []),
    *(["tasks.trading.stages"] if HAS_TRADING else []),
]
# Routers `conveyor serve` adds to the HTTP API (conveyor.web.server); the command groups
# `conveyor` adds, CLI_EXTENSIONS, are in config/__init__.py (read without this module).
HTTP_EXTENSIONS = {
    **({"files": "pipelines.files.http:router"} if HAS_FILES else {}),
    **({"email": "pipelines.email.http:router"} if HAS_EMAIL else {}),
    **({"publisher": "pipelines.publisher.http:router"} if HAS_PUBLISHER else {}),
    **({"trading": "pipelines.trading.http:router"} if HAS_TRADING else {}),
}
MIGRATIONS = "config.migrations:upgrade"

settings = get_settings()
_found = attach(settings)
if _found is not None:
    settings = settings.with_urls(_found.redis_url, _found.database_url)

app = Celery("conveyor", include=TASK_MODULES)
app.config_from_object(celery_config(settings, queues=QUEUES, default_queue=DEFAULT_QUEUE))
app.conf.beat_schedule = {
    name: entry
    for name, entry in BEAT_SCHEDULE.items()
    if all(
        installed or not entry["task"].startswith(f"conveyor.{family}.")
        for family, installed in _FAMILIES.items()
    )
}
platform = Platform(app, settings, queues=QUEUES, default_queue=DEFAULT_QUEUE)
install(platform)
