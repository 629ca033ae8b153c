"""``conveyor serve`` as a real server process over real HTTP, with tokens made and revoked
by ``conveyor tokens``: a job submitted over HTTP is run by a worker and shown with its
result; nothing the server or the commands log holds a token's secret."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor import registry
from conveyor.db import schema as s

pytestmark = pytest.mark.timeout(120)

CONVEYOR = str(Path(sys.executable).parent / "conveyor")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def conveyor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONVEYOR, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def server(platform: Any, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``conveyor serve`` on a free port: its base URL and its log file."""
    registry.write(platform.engine, platform.stages.values())
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "CONVEYOR_LOG_FORMAT": "json", "CONVEYOR_LOG_LEVEL": "DEBUG"},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield base, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    # A graceful shutdown: uvicorn finishes, then ends by the signal it caught (as supervisors expect).
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]
    assert "Finished server process" in log.read_text()


def test_serve_submit_run_show_cancel_revoke(
    server: tuple[str, Path], worker: Any, platform: Any, tag: str
) -> None:
    base, log = server
    owner = f"web-{tag}"
    created = conveyor_cli("tokens", "create", "--owner", owner, "--scope", "read", "--scope", "submit")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()  # the secret alone on stdout
    assert secret.startswith("cvy_") and "\n" not in secret and secret not in created.stderr
    token_id = secret.split("_")[1]
    listed = json.loads(conveyor_cli("tokens", "list", "--owner", owner, "--json").stdout)
    assert [t["id"] for t in listed] == [token_id] and listed[0]["scopes"] == ["read", "submit"]
    assert secret.split("_", 2)[2] not in json.dumps(listed)

    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=base, headers=headers, timeout=10) as http:
        assert (
            http.get("/openapi.json").json()["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        )
        made = http.post("/jobs", json={"stage": "conveyor.demo.square", "payload": {"n": 6}})
        assert made.status_code == 201, made.text
        job_id = made.json()["id"]
        assert platform.job(job_id).wait(30) == s.SUCCEEDED
        shown = http.get(f"/jobs/{job_id}").json()
        assert shown["status"] == s.SUCCEEDED and shown["result"] == {"n": 36} and shown["owner"] == owner
        later = http.post("/jobs", json={"stage": "conveyor.demo.square", "payload": {"n": 1}, "delay": 60})
        cancelled = http.post(f"/jobs/{later.json()['id']}/cancel", json={"reason": "not needed"})
        assert cancelled.json()["status"] == s.CANCELLED
        denied = http.post("/jobs", json={"stage": "conveyor.demo.sqare"})
        assert denied.headers["content-type"].startswith("application/problem+json")
        assert denied.json()["suggestions"] == ["conveyor.demo.square"]

        revoked = conveyor_cli("tokens", "revoke", token_id)
        assert revoked.returncode == 0 and "revoked" in revoked.stdout
        after = http.get(f"/jobs/{job_id}")
        assert after.status_code == 401 and after.json()["type"] == "urn:conveyor:problem:unauthorized"
        assert conveyor_cli("tokens", "revoke", "0000000000000000").returncode == 1

    text = log.read_text()
    assert f"/jobs/{job_id}" in text  # the access log went to Conveyor's renderer...
    assert secret.split("_", 2)[2] not in text  # ...and no secret anywhere in the logs
    assert all(json.loads(line) for line in text.splitlines() if line.startswith("{"))
