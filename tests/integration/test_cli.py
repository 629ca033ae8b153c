"""`conveyor up` on the embedded default, and commands attaching to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.runfile import pid_alive
from tests.integration.http_support import free_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.sqlite]

CONVEYOR = str(Path(sys.executable).parent / "conveyor")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["CONVEYOR_HOME"] = str(home)
    env["CONVEYOR_HTTP_PORT"] = str(free_port())  # `up` serves its API there, not on 8000
    return env


def test_commands_explain_when_nothing_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [CONVEYOR, "jobs", "list"], env=_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "conveyor up" in proc.stderr


def test_up_writes_run_json_and_other_commands_attach(tmp_path: Path) -> None:
    env = _env(tmp_path)
    up = subprocess.Popen(
        [CONVEYOR, "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        run_json = tmp_path / "run.json"
        deadline = time.monotonic() + 60
        while not run_json.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        info = json.loads(run_json.read_text())
        assert info["pid"] == up.pid and info["redis_url"].startswith("redis://127.0.0.1:")
        second = subprocess.run([CONVEYOR, "up"], env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "already running" in second.stdout + second.stderr
        for args in (["jobs", "list"], ["dlq", "list"], ["db", "upgrade"]):
            res = subprocess.run([CONVEYOR, *args], env=env, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr
    finally:
        os.kill(up.pid, signal.SIGTERM)
        up.wait(timeout=60)
    assert not (tmp_path / "run.json").exists()
    assert info["redis_pid"] and not pid_alive(info["redis_pid"])
