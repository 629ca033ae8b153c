"""Tests for the embedded Redis server and the run.json file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conveyor.delivery.embedded import EmbeddedRedis, free_port, redis_binary, start_redis
from conveyor.runfile import (
    RUN_FILE,
    RunInfo,
    RunningError,
    claim_run,
    pid_alive,
    read_run_info,
    release_run,
)

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _info(pid: int, **kwargs: object) -> RunInfo:
    return RunInfo(
        pid=pid,
        redis_url="redis://127.0.0.1:1/0",
        database_url="sqlite:///x.db",
        started_at=time.time(),
        **kwargs,  # type: ignore[arg-type]
    )


def _port_refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except OSError:
        return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    srv = start_redis(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


# --- embedded redis -------------------------------------------------------


def test_redis_binary_is_bundled() -> None:
    binary = redis_binary()
    assert binary.name == "redis-server"
    assert os.access(binary, os.X_OK)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_start_and_stop(tmp_path: Path) -> None:
    srv = start_redis(tmp_path)
    assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
    assert pid_alive(srv.pid)
    client = redis.Redis.from_url(srv.url, decode_responses=True)
    try:
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert str(client.info("server")["redis_version"]).startswith("6.2")
        assert int(client.info("server")["process_id"]) == srv.pid
    finally:
        client.close()
    assert (tmp_path / "redis" / "redis.log").exists()

    srv.stop()
    assert not pid_alive(srv.pid)
    assert _port_refuses(srv.port)
    srv.stop()  # idempotent


def test_stop_from_another_process(server: EmbeddedRedis) -> None:
    code = (
        "import sys; from conveyor.delivery.embedded import EmbeddedRedis; "
        "EmbeddedRedis(url=sys.argv[1], pid=int(sys.argv[2]), port=int(sys.argv[3])).stop()"
    )
    subprocess.run(
        [sys.executable, "-c", code, server.url, str(server.pid), str(server.port)],
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=30,
    )
    assert not pid_alive(server.pid)
    assert _port_refuses(server.port)


def test_server_is_not_our_child(server: EmbeddedRedis) -> None:
    # Detached via an intermediate process, so it can never become our zombie.
    with pytest.raises(ChildProcessError):
        os.waitpid(server.pid, os.WNOHANG)


def test_start_fails_clearly_on_taken_port(server: EmbeddedRedis, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)in use|served by another redis"):
        start_redis(tmp_path / "other", port=server.port, ready_timeout=5.0)
    assert pid_alive(server.pid)


# --- run.json -------------------------------------------------------------


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(_dead_pid())
    assert not pid_alive(0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs")
def test_pid_alive_treats_zombie_as_dead() -> None:
    proc = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while "Z" not in Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2][:3]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()


def test_run_info_json_round_trip() -> None:
    info = _info(123, redis_pid=456, extra={"flower": "http://127.0.0.1:5555", "workers": [1]})
    assert RunInfo.from_json(info.to_json()) == info


def test_claim_on_empty_home_writes_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    info = _info(os.getpid())
    assert claim_run(home, info) == info
    assert json.loads((home / RUN_FILE).read_text())["pid"] == os.getpid()
    assert read_run_info(home) == info
    assert not list(home.glob("*.tmp"))


def test_second_claim_with_live_pid_raises(tmp_path: Path) -> None:
    first = _info(os.getpid())
    claim_run(tmp_path, first)
    with pytest.raises(RunningError, match=rf"already running \(pid {os.getpid()}\)") as exc:
        claim_run(tmp_path, _info(os.getpid(), extra={"second": True}))
    assert isinstance(exc.value, RuntimeError)
    assert exc.value.existing == first
    assert read_run_info(tmp_path) == first


def test_stale_run_is_replaced(tmp_path: Path) -> None:
    stale = _info(_dead_pid())
    (tmp_path / RUN_FILE).write_text(stale.to_json())
    assert read_run_info(tmp_path) is None
    ours = _info(os.getpid())
    assert claim_run(tmp_path, ours) == ours
    assert read_run_info(tmp_path) == ours


@pytest.mark.parametrize("text", ["{not json", "[]", '{"pid": "x"}', "", "\xff"])
def test_corrupt_run_file_reads_as_none(tmp_path: Path, text: str) -> None:
    (tmp_path / RUN_FILE).write_text(text, encoding="latin-1")
    assert read_run_info(tmp_path) is None
    ours = _info(os.getpid())
    assert claim_run(tmp_path, ours) == ours


def test_missing_home_reads_as_none(tmp_path: Path) -> None:
    assert read_run_info(tmp_path / "nope") is None


def test_release_only_removes_own_file(tmp_path: Path) -> None:
    ours = _info(os.getpid())
    claim_run(tmp_path, ours)
    release_run(tmp_path, os.getpid() + 1)
    assert read_run_info(tmp_path) == ours
    release_run(tmp_path, os.getpid())
    assert not (tmp_path / RUN_FILE).exists()
    release_run(tmp_path, os.getpid())  # nothing left to remove: no error
