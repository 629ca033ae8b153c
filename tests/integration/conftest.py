"""Fixtures of the integration tests: the HTTP API's (``client``, ``http``: see
``http_support``; a module that defines its own ``client`` keeps it), and ``db``."""

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.http_support import client, http


@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, platform: Any) -> Iterator[Any]:
    """The platform on Postgres, then on a fresh SQLite file."""
    if request.param == "sqlite":
        yield request.getfixturevalue("on_sqlite")
    else:
        yield platform


__all__ = ["client", "db", "http"]
