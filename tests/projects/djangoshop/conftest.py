"""The documented pytest-django setup: Conveyor's fixtures, and a worker of the
deployment this shop calls by name (SHOP_DEPLOYMENT: its checkout)."""

import os
import subprocess

import pytest

pytest_plugins = ["conveyor.contrib.django.testing"]


@pytest.fixture(scope="session")
def deployment_worker(conveyor_workers) -> subprocess.Popen[bytes]:
    return conveyor_workers.start(root=os.environ["SHOP_DEPLOYMENT"], queues=["demo"], django=False)
