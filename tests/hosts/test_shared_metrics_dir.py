"""A metrics directory shared by hosts of one name: a worker starting on one host removes
the directories of its own node's dead workers only, never another host's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import service_env
from conveyor.runfile import local_node, owner_id
from tests.hosts.host import needs_unshare, run_in

pytestmark = [pytest.mark.timeout(120), needs_unshare]

ENABLE = """
from config.celery_app import platform
print(platform.metrics.enable().name)
"""


def test_a_worker_removes_only_its_own_nodes_dead_directories(platform: Any, tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = tmp_path / f"worker-{owner_id(gone.pid).replace('/', '+')}"  # this node's, dead
    here.mkdir()
    env = {"CONVEYOR_METRICS_DIR": str(tmp_path)}
    name = local_node().partition("/")[0]
    # Another host of the same name starts its worker: it cannot judge this node's pids.
    theirs = run_in(name, env, ENABLE, platform.settings).strip().splitlines()[-1]
    assert (tmp_path / theirs).is_dir() and theirs != here.name
    assert here.is_dir()
    # A worker of this node sees its dead one and removes it; the other host's stays.
    ours = _run_here(env, platform)
    assert not here.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs, ours])


def _run_here(env: dict[str, str], platform: Any) -> str:
    """``ENABLE`` in a process of this very node (no namespaces of its own)."""
    out = subprocess.run(
        [sys.executable, "-c", ENABLE],
        env=service_env(platform.settings, env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]
