"""Conveyor's settings in a Django project: ``settings.CONVEYOR``, over the environment.

``CONVEYOR = {"REDIS_URL": ..., "DB_SCHEMA": ..., "DATABASE": "default", "TEST": {...}}``:
each key is a :class:`~conveyor.settings.ConveyorSettings` field in capitals; the
database is always one of Django's (``DATABASE``, an alias), so a submit joins Django's
transaction. While Django runs tests, ``TEST`` overrides the rest, and the database is
Django's test database."""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from pydantic import Field
from sqlalchemy.engine import URL

from conveyor.settings import ConveyorSettings

APP = "conveyor.contrib.django"
OWN_KEYS = {"DATABASE", "TEST", "QUEUES", "DEFAULT_QUEUE"}  # the integration's, not ConveyorSettings'
ENGINES = {
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.db.backends.sqlite3": "sqlite",
}


class DjangoConveyorSettings(ConveyorSettings):
    """Conveyor's settings, plus what a worker process started for tests needs to know."""

    test_databases: dict[str, str] = Field(
        default_factory=dict,
        description="set by conveyor.contrib.django.testing for the workers it starts: Django's "
        "test database of each alias (the worker's stages then use it too), and TEST's services",
    )


def options() -> dict[str, Any]:
    """``settings.CONVEYOR`` as given (an empty dict when unset)."""
    given = getattr(django_settings, "CONVEYOR", None) or {}
    if not isinstance(given, dict):
        raise ImproperlyConfigured("settings.CONVEYOR must be a dict, e.g. {'REDIS_URL': 'redis://…'}")
    return dict(given)


def alias(using: str | None = None) -> str:
    """The Django database Conveyor's tables are in (``CONVEYOR["DATABASE"]``, default
    ``"default"``), unless a call names one."""
    name = using or options().get("DATABASE") or "default"
    if name not in django_settings.DATABASES:
        raise ImproperlyConfigured(
            f"settings.CONVEYOR names database {name!r}, which DATABASES does not have"
        )
    return str(name)


def running_tests() -> bool:
    """Whether Django's test environment is set up (``manage.py test``, pytest-django: its
    outgoing mail goes to ``mail.outbox``), or this is a worker started for its tests."""
    from django.core import mail

    return hasattr(mail, "outbox") or bool(DjangoConveyorSettings().test_databases)


def use_test_databases() -> None:
    """In a worker started for tests: point Django at the test databases the tests use."""
    for name, test_name in DjangoConveyorSettings().test_databases.items():
        django_settings.DATABASES[name]["NAME"] = test_name
        connections[name].settings_dict["NAME"] = test_name


def database_url(using: str | None = None) -> str:
    """A URL for the Django database ``using`` names, as it is now (during tests, the test
    database Django created)."""
    params = connections[alias(using)].settings_dict
    driver = ENGINES.get(params["ENGINE"])
    if driver is None:
        raise ImproperlyConfigured(
            f"Conveyor runs on PostgreSQL or SQLite; database {alias(using)!r} uses {params['ENGINE']}"
        )
    if driver == "sqlite":
        return f"sqlite:///{params['NAME']}"
    _needs_psycopg3()
    query = {k: str(v) for k, v in (params.get("OPTIONS") or {}).items() if k in {"sslmode", "options"}}
    url = URL.create(
        driver,
        username=params.get("USER") or None,
        password=params.get("PASSWORD") or None,
        host=params.get("HOST") or None,
        port=int(params["PORT"]) if params.get("PORT") else None,
        database=params.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def conveyor_settings(using: str | None = None) -> DjangoConveyorSettings:
    """Conveyor's settings for this process: the environment, then ``settings.CONVEYOR``
    (then its ``TEST`` part while tests run), on the Django database ``using`` names."""
    given = options()
    unknown = sorted(set(given) - OWN_KEYS - {k.upper() for k in ConveyorSettings.model_fields})
    if unknown:
        raise ImproperlyConfigured(
            f"settings.CONVEYOR has unknown keys {unknown}: use ConveyorSettings' names in capitals "
            "(REDIS_URL, DB_SCHEMA, ...) or DATABASE, TEST, QUEUES, DEFAULT_QUEUE"
        )
    if "DATABASE_URL" in given:
        raise ImproperlyConfigured(
            "settings.CONVEYOR takes no DATABASE_URL: Conveyor uses one of Django's databases so "
            "that a submit joins Django's transaction; name it with CONVEYOR['DATABASE'] (an alias)"
        )
    values = {k.lower(): v for k, v in given.items() if k not in OWN_KEYS}
    if running_tests():
        test = given.get("TEST") or {}
        if not test.get("REDIS_URL"):
            raise ImproperlyConfigured(
                "Django is running tests: set settings.CONVEYOR['TEST']['REDIS_URL'] to a Redis "
                "database only tests use, so that no job of a test reaches your other workers"
            )
        # No connection is kept between uses: Django drops the test database at the end.
        values.setdefault("db_pool_size", 0)
        values.update({k.lower(): v for k, v in test.items()})
    values["database_url"] = database_url(using)
    return DjangoConveyorSettings(**values)


def site_settings() -> DjangoConveyorSettings | None:
    """:func:`conveyor_settings`, for ``conveyor.connect()`` in a process Django runs, when
    the project configures Conveyor through Django (``settings.CONVEYOR``, or this app in
    ``INSTALLED_APPS``). None when Django has no settings (``DJANGO_SETTINGS_MODULE`` unset
    and nothing configured), or the project leaves Conveyor to the environment."""
    try:
        installed = list(django_settings.INSTALLED_APPS)  # Django reads its own variable here
    except ImproperlyConfigured:
        return None
    ours = any(a == APP or a.startswith(APP + ".") for a in installed)
    if not ours and getattr(django_settings, "CONVEYOR", None) is None:
        return None
    return conveyor_settings()


def _needs_psycopg3() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:  # pragma: no cover - psycopg is one of Conveyor's own dependencies
        raise ImproperlyConfigured("Conveyor's Django integration needs psycopg 3") from None
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise ImproperlyConfigured(
            "Django is using psycopg2; Conveyor joins Django's transaction on psycopg 3, which "
            "Django prefers when it is installed: pip uninstall psycopg2 (Conveyor installs psycopg)"
        )
