"""`conveyor demo` with no environment: embedded Redis + SQLite, a real worker, twice in a row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(400), pytest.mark.sqlite]


ROOT = Path(__file__).resolve().parents[2]


def test_demo_with_no_env_passes_twice_in_the_same_home(tmp_path: Path) -> None:
    """Run as the Quickstart does, from the checkout (the deployment is not installed); only
    the home is moved out of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "PYTHONPATH"}
    env["CONVEYOR_HOME"] = str(tmp_path / "home")
    for run in (1, 2):
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "conveyor"), "demo", "--jobs", "150"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
        assert proc.returncode == 0, f"run {run}:\n{proc.stdout}\n{proc.stderr}"
        assert "self-check passed" in proc.stdout
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
