"""What the HTTP API's tests share: the app in process around a client of the test
services, token factories, problem-detail checks, and ``conveyor serve`` as a live server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import conveyor
from conveyor.client import registry
from conveyor.web import create_app, tokens

PROBLEM = "application/problem+json"
CONVEYOR = str(Path(sys.executable).parent / "conveyor")
Token = Callable[..., str]


@pytest.fixture(scope="module")
def client(platform: Any) -> Iterator[conveyor.Client]:
    """A client of the test services, with the stage registry written as `conveyor db upgrade` does."""
    registry.write(platform.engine, platform.stages.values())
    c = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(client: conveyor.Client) -> Iterator[TestClient]:
    """The API in process around ``client``."""
    with TestClient(create_app(client)) as test_client:
        yield test_client


def token_fixture(*default_scopes: str) -> Any:
    """A ``token`` fixture: ``token(owner, *scopes)`` is a new token's bearer string, with
    ``default_scopes`` when none are given."""

    @pytest.fixture
    def token(platform: Any) -> Token:
        def make(owner: str, *scopes: str) -> str:
            return tokens.create(platform.engine, owner=owner, scopes=scopes or default_scopes).secret

        return make

    return token


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def problem(resp: httpx.Response, status: int, kind: str | None = None) -> dict[str, Any]:
    """The problem document of ``resp``, checked to be RFC 9457's."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    body: dict[str, Any] = resp.json()
    assert body["status"] == status and body["title"] and body["instance"] == resp.request.url.path
    assert body["type"] == (f"urn:conveyor:problem:{kind}" if kind else body["type"])
    return body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def conveyor_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONVEYOR, *args], capture_output=True, text=True, timeout=60, check=False, env=env)


def wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    """Until ``base``'s ``/health`` answers 200 (the process must stay up meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM, then SIGKILL of the group after 20 s; it must have ended by the signal or 0."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # A graceful shutdown: uvicorn finishes, then ends by the signal it caught (as supervisors expect).
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]


@contextmanager
def serving(
    platform: Any, log: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``conveyor serve`` on a free port of the test services: its base URL and process."""
    registry.write(platform.engine, platform.stages.values())
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base, proc
    finally:
        stop(proc, log)
