"""Several "hosts" on one machine: network namespaces on a bridge, each with its own
hostname and PID namespace, running real prefork ``conveyor worker`` processes.

A host is ``ip netns exec NS unshare --uts --pid --fork --mount-proc`` around a tiny init
(PID 1 of its namespace, which reaps orphans); its workers are started under ``nsenter``
into that init's namespaces. Its only link is a veth pair to a Linux bridge in the root
namespace, on a private subnet ``10.231.N.0/24`` that exists only in the namespaces made
here (no default route: nothing a host sends can leave the machine). Services the hosts
use listen on the bridge's address, so taking a host's veth down really cuts it off: no
proxy and no Unix socket bridges the gap.

Names carry the subnet number ``N`` (held by an ``flock`` for the life of the session)
and a random suffix, so two sessions never collide; whatever a crashed session with the
same ``N`` left behind is swept when ``N`` is taken again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.delivery.procs import start_worker
from conveyor.settings import ConveyorSettings
from tests.fault.servers import PrivatePostgres, PrivateRedis, private_postgres, private_redis
from tests.locks import claim_numbered
from tests.rabbit_support import PrivateRabbit

SUBNET_PREFIX = "10.231"
QUEUES = ("demo",)

# PID 1 of a host: names the host, says it is up, then reaps whatever is orphaned in its
# PID namespace until it is killed (and the kernel kills the namespace with it). It dies
# with its parent (unshare), which dies with the test process (see Host.start): a session
# killed outright leaves no host running.
INIT = """
import ctypes, os, signal, socket, sys, time
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
socket.sethostname(sys.argv[1])
print("up", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip`` with ``args`` (raises with its stderr when ``check`` and it fails)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def can_run() -> str | None:
    """Why this machine cannot run the harness (not root, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "the multi-host harness needs root (network and PID namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} not found"
    return None


def _claim_subnet() -> tuple[int, int]:
    """A subnet number no other session on this machine holds, and the descriptor whose
    ``flock`` holds it."""
    claimed = claim_numbered("conveyor-multihost-net", range(1, 255))
    if claimed is None:
        raise RuntimeError("no free multi-host subnet")
    return claimed


def _leftovers(n: int) -> Path:
    """Where a session with subnet number ``n`` notes its servers, for the next sweep."""
    return Path(tempfile.gettempdir()) / f"conveyor-multihost-net-{n}.servers"


def _sweep(n: int) -> None:
    """Remove what a crashed session with subnet number ``n`` left: its servers, its
    namespaces (and every process in them), its bridge and its veths. Only called with
    ``n``'s lock held."""
    mark = f"{n:03d}"
    noted = _leftovers(n)
    if noted.exists():
        for line in noted.read_text().splitlines():
            pid, _, directory = line.partition(" ")
            with contextlib.suppress(OSError, ValueError):
                command = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
                if b"redis-server" in command or b"postgres" in command:  # not a reused pid
                    os.kill(int(pid), signal.SIGKILL)  # a Postgres backend exits with its postmaster
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
        noted.unlink()
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"conveyor-{mark}"):
            for pid in ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", name, check=False)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith((f"cvb{mark}", f"cv{mark}")):
                ip("link", "del", name, check=False)


@dataclass
class Network:
    """A bridge in the root namespace with the subnet's first address."""

    number: int
    suffix: str
    lock_fd: int

    @property
    def mark(self) -> str:
        return f"{self.number:03d}{self.suffix}"

    @property
    def bridge(self) -> str:
        return f"cvb{self.mark}"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{self.number}.0/24"

    @property
    def gateway(self) -> str:
        """The bridge's address: where services listen for the hosts."""
        return f"{SUBNET_PREFIX}.{self.number}.1"

    def address(self, index: int) -> str:
        return f"{SUBNET_PREFIX}.{self.number}.{10 + index}"

    def destroy(self) -> None:
        ip("link", "del", self.bridge, check=False)
        os.close(self.lock_fd)


def make_network() -> Network:
    """Claim a subnet, sweep what a dead session left on it, create the bridge."""
    number, fd = _claim_subnet()
    try:
        _sweep(number)
        net = Network(number, uuid.uuid4().hex[:4], fd)
        ip("link", "add", "name", net.bridge, "type", "bridge")
        ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
    except BaseException:
        _sweep(number)
        os.close(fd)
        raise
    return net


@dataclass
class Services:
    """What the hosts connect to, all on the bridge address. ``broker_url`` is for a
    message broker other than Redis (a private RabbitMQ node on the bridge, with a
    non-guest user since guest is loopback-only); None: Redis is the broker."""

    redis: PrivateRedis
    postgres: PrivatePostgres
    rabbit: PrivateRabbit | None = None

    @property
    def broker_url(self) -> str | None:
        return self.rabbit.url if self.rabbit is not None else None

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def database_url(self) -> str:
        return self.postgres.url

    def env(self) -> dict[str, str]:
        """``CONVEYOR_*`` variables pointing a process at these services."""
        env = {"CONVEYOR_REDIS_URL": self.redis_url, "CONVEYOR_DATABASE_URL": self.database_url}
        if self.broker_url is not None:
            env["CONVEYOR_BROKER_URL"] = self.broker_url
        return env

    def destroy(self) -> None:
        self.redis.stop()
        self.postgres.destroy()
        if self.rabbit is not None:
            self.rabbit.close()


# A cut host's transactions keep their locks until Postgres notices. The relay's lock
# transaction limits its own idle time (conveyor.store.db.dialect.SINGLETON_IDLE_LIMIT_MS);
# the server-wide limit is only a backstop, as long as a deployment would set it (stage
# bodies may keep a transaction open while they compute). A silent peer is found by
# keepalives when idle, by tcp_user_timeout while the server's data is unacknowledged
# (both longer than the relay's limit, so a test sees which one ended a transaction).
POSTGRES_OPTIONS = {
    "max_connections": "200",
    "idle_in_transaction_session_timeout": "30s",
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def start_services(
    net: Network, postgres_options: Mapping[str, str] | None = None, *, rabbitmq: bool = False
) -> Services:
    """A private Redis and Postgres listening on the bridge address, migrated; with
    ``rabbitmq``, a private RabbitMQ node there too (Celery's broker)."""
    redis_server = private_redis(host=net.gateway)
    try:
        pg = private_postgres(
            {**POSTGRES_OPTIONS, **(postgres_options or {})}, host=net.gateway, subnet=net.subnet
        )
    except BaseException:
        redis_server.stop()
        raise
    services = Services(redis_server, pg)
    try:
        assert redis_server.proc is not None
        postmaster = (pg.datadir / "postmaster.pid").read_text().split()[0]
        _leftovers(net.number).write_text(f"{redis_server.proc.pid}\n{postmaster} {pg.datadir.parent}\n")
        from config.migrations import upgrade
        from conveyor.store.db.engine import make_engine

        engine = make_engine(pg.url, pool_size=0)
        upgrade(engine)
        engine.dispose()
        if rabbitmq:
            services.rabbit = PrivateRabbit(bind=net.gateway)
            services.rabbit.start(first=True)
    except BaseException:
        services.destroy()
        raise
    return services


@dataclass
class Worker:
    """One ``conveyor worker`` on a host (``proc`` is ``nsenter`` in the root namespace)."""

    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Host:
    """A network namespace with its own hostname and PID namespace, linked to the bridge."""

    net: Network
    index: int
    log_dir: Path
    init: subprocess.Popen[str] | None = None
    init_pid: int = 0  # PID 1 of the host, as the root namespace sees it
    workers: list[Worker] = field(default_factory=list)

    @property
    def name(self) -> str:
        """Its hostname (what lease owners and Celery node names carry)."""
        return f"cv{self.net.mark}-h{self.index}"

    @property
    def namespace(self) -> str:
        return f"conveyor-{self.net.mark}-h{self.index}"

    @property
    def veth(self) -> str:
        """The root-namespace end of its link (the bridge port)."""
        return f"cv{self.net.mark}h{self.index}"

    @property
    def address(self) -> str:
        return self.net.address(self.index)

    def start(self) -> None:
        """Create the namespace and its link, start PID 1."""
        ip("netns", "add", self.namespace)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.namespace)
        ip("link", "set", self.veth, "master", self.net.bridge, "up")
        ip("-n", self.namespace, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip("-n", self.namespace, "link", "set", "eth0", "up")
        ip("-n", self.namespace, "link", "set", "lo", "up")
        self.init = subprocess.Popen(
            [
                "ip", "netns", "exec", self.namespace,
                "unshare", "--uts", "--pid", "--fork", "--mount-proc",
                sys.executable, "-c", INIT, self.name,
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # unshare's complaint when its child is SIGKILLed
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        assert self.init.stdout is not None
        if self.init.stdout.readline().strip() != "up":
            raise RuntimeError(f"host {self.name}: init did not start")
        self.init_pid = _namespace_init(self.init.pid)

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["nsenter", "-t", str(self.init_pid), "-p", "-u", "-m", "-n", "--"]

    def run(self, *args: str, timeout: float = 30) -> str:
        """Run a short command on this host; its stdout."""
        return subprocess.run(
            [*self.prefix(), *args], capture_output=True, text=True, timeout=timeout, check=True
        ).stdout

    def start_worker(
        self,
        settings: ConveyorSettings,
        env: Mapping[str, str],
        *,
        concurrency: int = 2,
        queues: Sequence[str] = QUEUES,
        wait: bool = True,
    ) -> Worker:
        """Start a prefork ``conveyor worker`` on this host, named ``w<n>@<hostname>``."""
        log = self.log_dir / f"{self.name}-worker{len(self.workers)}.log"
        proc = start_worker(
            settings,
            queues=queues,
            concurrency=concurrency,
            hostname=f"w{len(self.workers)}@{self.name}",
            log_path=log,
            extra_env=env,
            prefix=self.prefix(),
        )
        worker = Worker(proc, log)
        self.workers.append(worker)
        if wait:
            wait_ready(worker)
        return worker

    def pids(self) -> list[int]:
        """Every process of this host, as the root namespace sees them."""
        return [int(p) for p in ip("netns", "pids", self.namespace, check=False).stdout.split()]

    def kill(self) -> None:
        """Kill every process of this host at once: SIGKILL to its PID 1 makes the kernel
        kill the whole PID namespace."""
        if self.init_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, signal.SIGKILL)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=10)
        if self.init is not None:
            self.init.wait(timeout=10)

    def link_down(self) -> None:
        """Cut this host off the bridge (its processes keep running)."""
        ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        """Reconnect this host."""
        ip("link", "set", self.veth, "up")

    def destroy(self) -> None:
        """Kill its processes, delete its namespace and link."""
        self.kill()
        for pid in self.pids():  # anything that entered the network namespace otherwise
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ip("netns", "del", self.namespace, check=False)
        ip("link", "del", self.veth, check=False)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (kept across exec)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _namespace_init(outer: int, timeout: float = 10.0) -> int:
    """The pid (root namespace) of the process below ``outer`` that is PID 1 of a new PID
    namespace (``unshare --fork``'s child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [outer]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and line.split()[-1] == "1" and len(line.split()) > 2:
                        return pid
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        time.sleep(0.02)
    raise RuntimeError(f"no PID namespace init below {outer}")


def wait_ready(worker: Worker, timeout: float = 60.0) -> None:
    """Block until the worker logs that it is ready (or died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise AssertionError(f"worker exited with {worker.proc.returncode}:\n{worker.text()[-3000:]}")
        if " ready." in worker.text():
            return
        time.sleep(0.1)
    raise AssertionError(f"worker not ready after {timeout}s:\n{worker.text()[-3000:]}")


@dataclass
class Cluster:
    """A network, its services and hosts; ``env`` is what every worker gets on top of
    the services' URLs (the timers a test prints)."""

    net: Network
    services: Services
    settings: ConveyorSettings
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    hosts: list[Host] = field(default_factory=list)
    started: int = 0  # hosts ever added: a name is never reused within a cluster

    def add_host(self, *, workers: int = 1, concurrency: int = 2, queues: Sequence[str] = QUEUES) -> Host:
        """A new host running ``workers`` worker processes on ``queues``."""
        host = Host(self.net, self.started, self.log_dir)
        self.started += 1
        self.hosts.append(host)
        host.start()
        env = {**self.services.env(), **self.env}
        for _ in range(workers):
            host.start_worker(self.settings, env, concurrency=concurrency, queues=queues, wait=False)
        for worker in host.workers:
            wait_ready(worker)
        return host

    def host_of(self, address: str) -> Host | None:
        """The host with this address (a Postgres client_addr), if any."""
        return next((h for h in self.hosts if h.address == address), None)

    def destroy_hosts(self) -> None:
        for host in self.hosts:
            host.destroy()
        self.hosts.clear()


@contextlib.contextmanager
def cluster(
    settings: ConveyorSettings,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    postgres_options: Mapping[str, str] | None = None,
    rabbitmq: bool = False,
) -> Iterator[Cluster]:
    """A bridge, private Redis and Postgres on it, and (added by the caller) hosts; all
    removed afterwards, whatever happened."""
    net = make_network()
    try:
        services = start_services(net, postgres_options, rabbitmq=rabbitmq)
        try:
            hosts_settings = settings.with_urls(services.redis_url, services.database_url)
            hosts_settings = hosts_settings.model_copy(update={"broker_url": services.broker_url})
            c = Cluster(net, services, hosts_settings, log_dir)
            c.env.update(env or {})
            try:
                yield c
            finally:
                c.destroy_hosts()
        finally:
            services.destroy()
            _leftovers(net.number).unlink(missing_ok=True)
    finally:
        _sweep(net.number)
        net.destroy()


def timer_env(**values: float) -> dict[str, str]:
    """``CONVEYOR_<NAME>`` variables from keyword values (``lease_timeout=3``)."""
    return {f"CONVEYOR_{k.upper()}": str(v) for k, v in values.items()}


def describe(env: Mapping[str, str]) -> str:
    """The settings a run uses, one ``name=value`` per line, for its output."""
    return "\n".join(
        f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("CONVEYOR_") and "URL" not in k
    )


__all__: Sequence[str] = (
    "Cluster",
    "Host",
    "Network",
    "Services",
    "Worker",
    "can_run",
    "cluster",
    "describe",
    "make_network",
    "start_services",
    "timer_env",
)
