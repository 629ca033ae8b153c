"""Fixtures of the HTTP API's tests (``client``, ``http``): see ``http_support``. A module
that defines its own ``client`` keeps it."""

from tests.integration.http_support import client, http

__all__ = ["client", "http"]
