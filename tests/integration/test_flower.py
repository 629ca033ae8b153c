"""`conveyor flower` for real: read-only, behind basic auth, fed by a real prefork worker.

Flower runs as the CLI runs it (``conveyor flower`` → ``celery flower`` in its own session)
and learns tasks only from worker events, so it is started, and seen to receive the
worker's events, before the job is submitted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from conveyor.delivery.procs import service_env, start_worker, stop

pytestmark = pytest.mark.timeout(180)

CONVEYOR = Path(sys.executable).parent / "conveyor"
USER = "conveyor"  # the default ``flower_user`` setting
STAGE = "conveyor.demo.square"
READ_ONLY = "Read only mode is enabled"


def _eventually(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    value: Any = None
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except requests.RequestException as exc:
            last_exc, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s (last value {value!r}, last error {last_exc!r})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _log(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


@dataclass
class Flower:
    url: str
    auth: tuple[str, str]
    cli: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("auth", self.auth)
        return requests.get(f"{self.url}{path}", timeout=10, **kwargs)

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("auth", self.auth)
        return requests.post(f"{self.url}{path}", timeout=10, **kwargs)

    def server_pids(self) -> list[int]:
        """The ``celery flower`` process(es) the CLI started."""
        return _children(self.cli.pid)

    def stop(self) -> int:
        """Stop the CLI as Ctrl-C does (it then stops Flower); never leave Flower behind."""
        servers = self.server_pids()
        code = stop(self.cli, sig=signal.SIGINT)
        for pid in servers:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return code


@pytest.fixture
def flower(platform: Any, tmp_path: Path) -> Iterator[Flower]:
    port = _free_port()
    password = f"pw-{uuid.uuid4().hex}"
    log = tmp_path / "flower.log"
    cli = subprocess.Popen(
        [str(CONVEYOR), "flower", "--port", str(port), "--password", password],
        env=service_env(platform.settings),
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    f = Flower(url=f"http://127.0.0.1:{port}", auth=(USER, password), cli=cli, log=log)
    try:

        def answers() -> bool:
            if cli.poll() is not None:
                raise AssertionError(f"conveyor flower exited with {cli.returncode}:\n{_log(log)}")
            return f.get("/healthcheck").status_code == 200

        _eventually(answers, 30, f"Flower answering on {f.url}\n{_log(log)}")
        yield f
    finally:
        f.stop()


@pytest.fixture
def prefork_worker(
    platform: Any, flower: Flower, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real prefork worker, started after Flower; yields (hostname pattern, process)."""
    pattern = f"flower-{uuid.uuid4().hex[:8]}@%h"
    log = tmp_path / "worker.log"
    proc = start_worker(platform.settings, queues=["demo"], concurrency=1, hostname=pattern, log_path=log)
    try:
        yield pattern, proc
    finally:
        stop(proc)


def test_flower_is_read_only_behind_basic_auth_and_sees_a_real_job(
    platform: Any, flower: Flower, prefork_worker: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    pattern, worker = prefork_worker
    prefix = pattern.partition("@")[0] + "@"

    # The worker's name as Flower knows it (control: inspect/ping)...
    def worker_name() -> str | None:
        assert worker.poll() is None, f"worker exited:\n{_log(tmp_path / 'worker.log')}"
        r = flower.get("/api/workers", params={"refresh": "1"})
        assert r.status_code == 200, r.text
        return next((n for n in r.json() if n.startswith(prefix)), None)

    name: str = _eventually(worker_name, 30, "worker listed by /api/workers")

    # ...and Flower's event receiver is live (it has the worker online from its events), so
    # the job's task events cannot be published before Flower listens.
    def online() -> bool:
        r = flower.get("/api/workers", params={"status": "1"})
        return r.status_code == 200 and r.json().get(name) is True

    _eventually(online, 30, f"Flower receiving events of {name}\n{_log(flower.log)}")

    # Workers send no task events of their own accord (CONVEYOR_TASK_EVENTS is off): Flower
    # turns them on with an enable_events broadcast every few seconds. A job run before the
    # first one reached this worker is not seen, so submit until one is, as a user who
    # opened Flower would see the next jobs.
    task_ids: list[str] = []

    def task_seen() -> dict[str, Any] | None:
        r = flower.get("/api/tasks")
        assert r.status_code == 200, r.text
        tasks = r.json()
        # Whole: a job whose received event went out before events were turned on shows in
        # Flower as SUCCESS with no name (seen in CI); the next jobs are seen whole.
        whole = (tasks[t] for t in task_ids if t in tasks and tasks[t].get("state") == "SUCCESS")
        return next((task for task in whole if task.get("name")), None)

    def job_seen() -> dict[str, Any] | None:
        handle = platform.submit(STAGE, {"n": 4})
        assert handle.wait(60) == "succeeded"
        assert handle.result == {"n": 16}
        # On a first publish the Celery task id is the job id; if the relay had to republish
        # (the first message lost, or taken by a worker of another session sharing the test
        # Redis DB), the row names the newer task id.
        task_ids.extend([handle.id, handle.row()["celery_task_id"]])
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if (seen := task_seen()) is not None:
                return seen
            time.sleep(0.2)
        return None

    try:
        task = _eventually(job_seen, 40, "a submitted job's task SUCCESS in /api/tasks")
    except AssertionError as exc:
        seen = {
            k: (v.get("name"), v.get("state"), v.get("worker"))
            for k, v in flower.get("/api/tasks").json().items()
        }
        raise AssertionError(
            f"{exc}\nflower saw {seen}\ntask ids {task_ids}\n"
            f"worker log:\n{_log(tmp_path / 'worker.log')}\nflower log:\n{_log(flower.log)}"
        ) from None
    assert task["name"] == STAGE
    assert task["uuid"] in task_ids
    info = flower.get(f"/api/task/info/{task['uuid']}")
    assert info.status_code == 200, info.text
    assert info.json()["name"] == STAGE and info.json()["state"] == "SUCCESS"

    # Basic auth: no credentials, or wrong ones, are refused.
    assert flower.get("/api/tasks", auth=None).status_code == 401
    assert flower.get("/api/tasks", auth=(USER, "wrong")).status_code == 401
    assert flower.get("/api/workers", auth=None).status_code == 401

    # Read-only: control endpoints are refused even with valid credentials.
    r = flower.post(f"/api/task/async-apply/{STAGE}", json={"kwargs": {"n": 1}})
    assert r.status_code == 403 and READ_ONLY in r.text, (r.status_code, r.text[:500])
    r = flower.post(f"/api/worker/shutdown/{name}")
    assert r.status_code == 403 and READ_ONLY in r.text, (r.status_code, r.text[:500])
    r = flower.post(f"/api/task/revoke/{task['uuid']}", data={"terminate": "true"})
    assert r.status_code == 403 and READ_ONLY in r.text, (r.status_code, r.text[:500])

    # Nothing was shut down: the worker is still up and Flower still sees it alive.
    time.sleep(1.0)
    assert worker.poll() is None
    assert online()

    # Stopping the CLI (Ctrl-C) stops the Flower server it started.
    servers = flower.server_pids()
    assert servers, "conveyor flower has no child process"
    code = stop(flower.cli, sig=signal.SIGINT)
    _eventually(lambda: not any(_alive(p) for p in servers), 15, "Flower server exited after the CLI")
    assert code == 0, f"conveyor flower exited with {code}:\n{_log(flower.log)}"
