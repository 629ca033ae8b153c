"""Hosts for the tests of this package (see :mod:`tests.hosts.host`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fault.conftest import spawn
from tests.helpers import cancelling_leftovers
from tests.hosts.host import Hosts

__all__ = ["hosts", "spawn"]


@pytest.fixture
def hosts(platform: Any, tmp_path: Path) -> Iterator[Hosts]:
    """Start hosts (``hosts.start(hostname, …)``); every one is killed afterwards,
    and the jobs the test left unfinished are cancelled."""
    started = Hosts(platform, tmp_path)
    with cancelling_leftovers(platform):
        try:
            yield started
        finally:
            started.close()
