"""RabbitMQ for tests: a vhost of its own per test session on the machine's node, and
private nodes (own port, own data directory) that a test may stop, kill, or wipe."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

RABBIT_HOST = os.environ.get("CONVEYOR_TEST_RABBIT_HOST", "127.0.0.1")


def ctl(*args: str, node: str | None = None, timeout: float = 60.0) -> str:
    """Run ``rabbitmqctl`` (against ``node``, default the machine's); its stdout."""
    cmd = ["rabbitmqctl", *(["-n", node] if node else []), "-q", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
    return out.stdout


def create_vhost(name: str, node: str | None = None, user: str = "guest") -> None:
    """A fresh vhost ``name`` that ``user`` may use fully."""
    with contextlib.suppress(subprocess.CalledProcessError):
        ctl("delete_vhost", name, node=node)
    ctl("add_vhost", name, node=node)
    ctl("set_permissions", "-p", name, user, ".*", ".*", ".*", node=node)


def delete_vhost(name: str, node: str | None = None) -> None:
    """Remove vhost ``name`` and everything in it."""
    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        ctl("delete_vhost", name, node=node)


def queue_stats(vhost: str, node: str | None = None) -> dict[str, tuple[int, int]]:
    """Per queue of ``vhost``: (messages ready, messages unacknowledged)."""
    out = ctl("list_queues", "-p", vhost, "name", "messages_ready", "messages_unacknowledged", node=node)
    stats: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1].isdigit():
            stats[parts[0]] = (int(parts[1]), int(parts[2]))
    return stats


def delete_queue(vhost: str, name: str, node: str | None = None) -> None:
    """Delete queue ``name`` of ``vhost`` (and the messages in it)."""
    ctl("delete_queue", "-p", vhost, name, node=node)


def _give_to_rabbitmq(path: Path) -> None:
    """Debian's ``rabbitmq-server`` run as root drops to the ``rabbitmq`` user: the node's
    directory must be that user's."""
    try:
        import pwd

        entry = pwd.getpwnam("rabbitmq")
    except KeyError:
        return
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, entry.pw_uid, entry.pw_gid)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRabbit:
    """A RabbitMQ node of one test: its own name, ports and data; ``stop``/``kill``/``start``
    keep the data (quorum queues survive), ``wipe`` loses it (a node replaced)."""

    def __init__(
        self, *, bind: str = "127.0.0.1", consumer_timeout_ms: int | None = None, stats_ms: int = 250
    ) -> None:
        self.name = f"conv{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.bind = bind
        self.dir = Path(tempfile.mkdtemp(prefix="conveyor-rabbit-"))
        self.user, self.password = "conveyor", uuid.uuid4().hex
        self.vhost = "conveyor"
        # Statistics every ``stats_ms``: rabbitmqctl's queue counts are that old at most.
        lines = [
            f"listeners.tcp.1 = {bind}:{self.port}",
            "loopback_users = none",
            f"collect_statistics_interval = {stats_ms}",
        ]
        if consumer_timeout_ms is not None:
            lines.append(f"consumer_timeout = {consumer_timeout_ms}")
        (self.dir / "rabbitmq.conf").write_text("\n".join(lines) + "\n")
        # A quorum queue reports its counts on its Raft tick (every 5 s by default); a
        # channel checks its consumer timeout on its own tick (every 60 s by default).
        ticks = f"{{quorum_tick_interval, {stats_ms}}}"
        if consumer_timeout_ms is not None:
            ticks += f", {{channel_tick_interval, {max(100, consumer_timeout_ms // 4)}}}"
        (self.dir / "advanced.config").write_text(f"[{{rabbit, [{ticks}]}}].\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The AMQP URL of this node's vhost (a non-guest user: guest is loopback-only)."""
        return f"amqp://{self.user}:{self.password}@{self.bind}:{self.port}/{self.vhost}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.dir / "log"),
            RABBITMQ_CONFIG_FILE=str(self.dir / "rabbitmq"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.dir / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.dir / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.dir / "pid"),
            RABBITMQ_ENABLED_PLUGINS="",
            ERL_EPMD_ADDRESS="127.0.0.1",
        )
        return env

    def start(self, *, first: bool = False) -> None:
        """Start the node and wait until it serves AMQP; the first start adds the user."""
        (self.dir / "enabled_plugins").write_text("[].\n")
        _give_to_rabbitmq(self.dir)
        self.proc = subprocess.Popen(
            ["rabbitmq-server"],
            env=self._env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while True:  # await_startup fails at once while the node's Erlang VM is not up yet
            try:
                ctl("await_startup", node=self.name, timeout=120)
                break
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    log = "\n".join(p.read_text()[-2000:] for p in (self.dir / "log").glob("*.log"))
                    raise RuntimeError(f"private RabbitMQ node did not start:\n{log}") from None
                time.sleep(0.5)
        if first:
            ctl("add_user", self.user, self.password, node=self.name)
            create_vhost(self.vhost, node=self.name, user=self.user)

    def stop(self) -> None:
        """A clean stop (data kept)."""
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            ctl("stop", node=self.name, timeout=60)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the node's Erlang VM (data kept, as after a power cut)."""
        self._kill_vm()
        self._reap()

    def _kill_vm(self) -> None:
        # Debian's script drops to the rabbitmq user, and the VM leaves our process group:
        # it is found by its pid file, or by the node name in its environment.
        pids: set[int] = set()
        with contextlib.suppress(OSError, ValueError):
            pids.add(int((self.dir / "pid").read_text().strip()))
        marker = f"RABBITMQ_NODENAME={self.name}".encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        pids.add(int(entry))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
            time.sleep(0.05)

    def wipe(self) -> None:
        """Stop the node and lose its data: the same address comes back as a new broker."""
        self.kill()
        shutil.rmtree(self.dir / "mnesia", ignore_errors=True)

    def _reap(self) -> None:
        self._kill_vm()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            self.proc = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.bind, self.port)) != 0:
                    return
            time.sleep(0.1)

    def close(self) -> None:
        """Kill the node and remove its files."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = [
    "PrivateRabbit",
    "create_vhost",
    "ctl",
    "delete_queue",
    "delete_vhost",
    "free_port",
    "queue_stats",
]
