"""The Django app: ``INSTALLED_APPS += ["conveyor.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class ConveyorConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Checks ``settings.CONVEYOR`` at start; ``manage.py conveyor`` comes with it."""

    name = "conveyor.contrib.django"
    label = "conveyor"
    verbose_name = "Conveyor"

    def ready(self) -> None:
        from conveyor.contrib.django import conf

        conf.alias()  # a wrong DATABASE alias fails at start, not at the first submit
