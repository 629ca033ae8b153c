"""The Django app: ``INSTALLED_APPS += ["conveyor.contrib.django"]``."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig

log = logging.getLogger("conveyor.django")


class ConveyorConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Checks ``settings.CONVEYOR`` at start; ``manage.py conveyor`` comes with it."""

    name = "conveyor.contrib.django"
    label = "conveyor"
    verbose_name = "Conveyor"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from conveyor.contrib.django import conf

        conf.alias()  # a wrong DATABASE alias fails at start, not at the first submit
        post_migrate.connect(migrate_conveyor, sender=self)


def migrate_conveyor(using: str, **_: Any) -> None:
    """``manage.py migrate`` (and so the test database Django creates) also brings
    Conveyor's tables up to date, as an installed app's own tables are: the platform's
    migrations, in Conveyor's schema of the database ``CONVEYOR["DATABASE"]`` names; and
    when ``CONVEYOR["APP"]`` names the project's own app module, its stages' registry."""
    from conveyor.client import registry
    from conveyor.contrib.django import conf
    from conveyor.deployment import import_object
    from conveyor.errors import ConfigurationError
    from conveyor.store.db.engine import make_engine
    from conveyor.store.db.migrate import upgrade

    if using != conf.alias():
        return
    settings = conf.conveyor_settings(using)
    assert settings.database_url
    engine = make_engine(settings.database_url, pool_size=0, schema=settings.db_schema)
    try:
        upgrade(engine)
        if "APP" in conf.options():  # the project runs stages of its own: register them
            platform = import_object(settings.app, settings).platform
            platform.app.loader.import_default_modules()
            registry.write(engine, platform.stages.values())
    except ConfigurationError as exc:  # a newer deployment migrated it: its own business
        log.warning("Conveyor's tables were left as they are: %s", exc)
    finally:
        engine.dispose()
