"""The shop's Celery app, in Celery's Django layout: ``conveyor worker`` with
CONVEYOR_APP=config.celery_app (the default) runs the stages of shop/tasks.py."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from conveyor.contrib.django.deployment import django_platform

platform = django_platform("shop")
app = platform.app
