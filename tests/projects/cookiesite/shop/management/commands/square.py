"""``manage.py square 7``: the site's own Celery app calls the deployment's stage by name."""

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand

import conveyor
from config.celery_app import app


class Command(BaseCommand):
    help = "Square n with the stage conveyor.demo.square, sent by the site's Celery app."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("n", type=int)

    def handle(self, *args: Any, n: int, **options: Any) -> None:
        result = app.send_task("conveyor.demo.square", kwargs={"n": n})
        answer = result.get(timeout=30)
        client = conveyor.connect()
        try:
            app.send_task("conveyor.demo.sqaure", kwargs={"n": n})
            refused = None
        except conveyor.UnknownStage as exc:
            refused = str(exc)
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"tasks", "pipelines", "bench"})
        report = {
            "id": result.id,
            "result": answer,
            "status": client.job(result.id).status(),
            "database": client.settings.database_url.rsplit("/", 1)[-1],
            "own_task_queue": app.amqp.router.route({}, "shop.tasks.total")["queue"].name,
            "refused": refused,
            "config": sys.modules["config"].__file__,
            "deployment_modules": loaded,
        }
        self.stdout.write(json.dumps(report))
