"""The site's settings package, ``config``, as cookiecutter-django makes it (the name of
Conveyor's own deployment's package too): the Celery app is loaded with Django."""

from .celery_app import app as celery_app

__all__ = ("celery_app",)
