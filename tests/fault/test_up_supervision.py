"""`conveyor up` restarts a child that dies instead of stopping the whole stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.runfile import pid_alive
from conveyor.store.db import schema as s
from tests.helpers import effect_count, eventually, job_row

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]

CONVEYOR = str(Path(sys.executable).parent / "conveyor")


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` and their command lines (from /proc)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def _worker_pid(up: subprocess.Popen[str], other_than: int = 0) -> int:
    pids = [p for p, cmd in _children(up.pid).items() if " worker " in cmd and p != other_than]
    return pids[0] if len(pids) == 1 else 0


def _scrape(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return ""


def start_up(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """``conveyor up`` with one pool slot, in a session of its own, its output piped."""
    return subprocess.Popen(
        [CONVEYOR, "up", "--concurrency", "1", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_up_restarts_a_killed_worker(platform: Any, tmp_path: Path, tag: str) -> None:
    # The session's Redis DB and Postgres database (CONVEYOR_REDIS_URL/DATABASE_URL are set
    # by tests/conftest.py), a home of its own for run.json and the logs.
    env = {**os.environ, "CONVEYOR_HOME": str(tmp_path), "CONVEYOR_HTTP_PORT": "0"}  # no API
    up = start_up(env)
    worker_log = tmp_path / "logs" / "worker.log"
    try:
        eventually(lambda: worker_log.exists() and " ready." in worker_log.read_text(), timeout=60)
        first = eventually(lambda: _worker_pid(up), timeout=10)
        os.killpg(first, signal.SIGKILL)  # the worker and its pool, as if the machine killed it
        second = eventually(lambda: _worker_pid(up, other_than=first), timeout=30)
        eventually(lambda: worker_log.read_text().count(" ready.") == 2, timeout=60)
        assert up.poll() is None, "conveyor up stopped when its worker died"
        job = platform.submit("conveyor.demo.effect", {"note": tag})
        eventually(lambda: job_row(platform, job.id)["status"] == s.SUCCEEDED, timeout=60)
        assert effect_count(platform, note=tag) == 1
        assert second in _children(up.pid)
    finally:
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
    said = " ".join(out.split())  # rich wraps long lines when it is not writing to a terminal
    assert up.returncode == 0, out
    assert f"worker (pid {first}) exited with code -9; restarting in 1s" in said, out
    assert f"worker restarted (pid {second})" in said, out
    assert not pid_alive(second), "conveyor up left its worker running"
    assert not (tmp_path / "run.json").exists()


def test_a_killed_up_takes_its_children_along_and_the_next_up_its_redis(tmp_path: Path) -> None:
    """``conveyor up`` SIGKILLed (or its terminal closed: SIGHUP) leaves nothing running:
    its worker, beat and API get SIGTERM from the kernel as it dies, and the next ``up``
    of the same home stops the embedded Redis the killed one left, then starts anew."""
    from tests.integration.http_support import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_HOME=str(tmp_path), CONVEYOR_HTTP_PORT=str(free_port()), CONVEYOR_SOFT_SHUTDOWN_TIMEOUT="5"
    )

    def started(up: subprocess.Popen[str]) -> dict[int, str]:
        def ready() -> dict[int, str]:
            kids = _children(up.pid)
            names = " ".join(kids.values())
            return kids if all(w in names for w in (" worker ", " beat", " serve ")) else {}

        return eventually(ready, timeout=60)

    first = start_up(env)
    kids = started(first)
    redis_pid = json.loads((tmp_path / "run.json").read_text())["redis_pid"]
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    eventually(lambda: not any(pid_alive(pid) for pid in kids), timeout=30)
    assert pid_alive(redis_pid)  # reparented by design: only the next up knows it

    metrics = free_port()
    second = start_up(env, "--metrics-port", str(metrics))
    try:
        started(second)
        assert not pid_alive(redis_pid), "the next up left the killed run's Redis running"
        scraped = eventually(lambda: _scrape(metrics), timeout=30)  # its worker serves them
        assert "conveyor_state_up 1.0" in scraped and 'conveyor_queue_length{queue_name="demo"}' in scraped
        second_kids = _children(second.pid)
        second.send_signal(signal.SIGHUP)  # the terminal it ran in was closed
        out, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert "stopping the embedded Redis" in out, out
    assert second.returncode == 0, out
    assert not any(pid_alive(pid) for pid in second_kids)
    assert not (tmp_path / "run.json").exists()
