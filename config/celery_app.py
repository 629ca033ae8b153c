"""The one Celery app: ``celery -A config.celery_app worker``."""

from __future__ import annotations

from celery import Celery

from config.beat import BEAT_SCHEDULE
from config.queues import DEFAULT_QUEUE, QUEUES
from config.settings import get_settings
from conveyor.celeryconfig import celery_config
from conveyor.platform import Platform
from conveyor.services import attach
from conveyor.worker import install

TASK_MODULES = ["tasks.demo", "tasks.files.stages"]
CLI_EXTENSIONS = {"files": "tasks.files.cli:app"}

settings = get_settings()
_found = attach(settings)
if _found is not None:
    settings = settings.with_urls(_found.redis_url, _found.database_url)

app = Celery("conveyor", include=TASK_MODULES)
app.config_from_object(celery_config(settings, queues=QUEUES, default_queue=DEFAULT_QUEUE))
app.conf.beat_schedule = BEAT_SCHEDULE
platform = Platform(app, settings, queues=QUEUES, default_queue=DEFAULT_QUEUE)
install(platform)
