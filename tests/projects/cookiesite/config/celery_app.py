"""The site's own Celery app, as cookiecutter-django writes it, plus Conveyor's router:
``send_task`` by stage name reaches the stage's queue; the site's own tasks keep theirs."""

import os

from celery import Celery

from conveyor.contrib.celery import router

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The router's client is made at the first send_task, by conveyor.connect(): inside Django,
# from settings.CONVEYOR and DATABASES (under pytest-django, its test database).
app.conf.task_routes = (router(),)
app.autodiscover_tasks()
