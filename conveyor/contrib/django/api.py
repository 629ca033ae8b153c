"""Conveyor's HTTP API (:mod:`conveyor.web`) served by a Django project itself, under a
path prefix, on ``conveyor.contrib.django.client()`` (Django's database, and during
tests its test database and ``CONVEYOR["TEST"]``)::

    # config/wsgi.py
    from django.core.wsgi import get_wsgi_application
    from conveyor.contrib.django.api import mount

    application = mount(get_wsgi_application(), "/conveyor")

The project stays a WSGI application: requests under the prefix go to the API (run by
``a2wsgi`` in an event loop of its own), every other one to Django as before (its URLs and
middleware never see the API's requests). The API is built at its first request, so
importing ``wsgi.py`` connects to nothing. The ``django`` extra brings FastAPI and a2wsgi.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.client.by_name import Client
    from conveyor.web.wsgi import Mounted, WSGIApp


def _client() -> Client:
    from conveyor.contrib.django import client

    return client()


def mount(application: WSGIApp, prefix: str = "/conveyor") -> Mounted:
    """``application`` (``get_wsgi_application()``) with the HTTP API under ``prefix``, on
    Conveyor's client for ``CONVEYOR["DATABASE"]`` (resolved at each request to the API, so
    it follows Django to its test database)."""
    from conveyor.web.wsgi import mount as wsgi_mount

    return wsgi_mount(application, prefix, _client)


__all__ = ["mount"]
