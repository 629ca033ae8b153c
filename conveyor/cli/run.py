"""``conveyor up``, ``worker``, ``beat``, ``flower`` and ``demo``: the commands that run
processes (``up`` supervises its children, restarting one that exits)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import typer

from conveyor.cli.common import cli, import_path, load_platform, migrate, run_command
from conveyor.cli.output import console, err, shown_url
from conveyor.delivery.procs import terminate_with_parent
from conveyor.errors import ConfigurationError
from conveyor.settings import ConveyorSettings


@dataclass
class _Child:
    """A process ``conveyor up`` keeps running: restarted, with backoff, whenever it exits."""

    name: str
    launch: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_exits: int = 0  # exits in a row, each within STABLE_AFTER seconds of its start
    restart_at: float | None = None

    def start(self) -> subprocess.Popen[bytes]:
        self.proc = proc = self.launch()
        self.started, self.restart_at = time.monotonic(), None
        return proc


RESTART_DELAY = 1.0  # seconds before the first restart; doubled per quick exit, up to the cap
RESTART_DELAY_MAX = 60.0
STABLE_AFTER = 60.0  # a child that ran this long starts its backoff over


def _tend(child: _Child, now: float) -> None:
    """Restart ``child`` once its backoff is over; when it has exited, schedule that."""
    if child.restart_at is not None:
        if now >= child.restart_at:
            err.print(f"conveyor up: {child.name} restarted (pid {child.start().pid})")
        return
    if child.proc is None or child.proc.poll() is None:
        return
    if now - child.started >= STABLE_AFTER:
        child.quick_exits = 0
    delay = min(RESTART_DELAY_MAX, RESTART_DELAY * 2**child.quick_exits)
    child.quick_exits += 1
    child.restart_at = now + delay
    err.print(
        f"[yellow]conveyor up: {child.name} (pid {child.proc.pid}) exited with code "
        f"{child.proc.returncode}; restarting in {delay:.0f}s[/yellow]"
    )


def _supervise(children: list[_Child]) -> None:
    """Keep ``children`` running until SIGTERM, SIGHUP (its terminal closed) or Ctrl-C."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, lambda *_: stopping.set())
    try:
        while not stopping.wait(0.5):
            now = time.monotonic()
            for child in children:
                _tend(child, now)
    except KeyboardInterrupt:
        pass


def _up_children(
    platform: Any,
    logs: Path,
    *,
    concurrency: int | None,
    flower: bool,
    api: tuple[str, int] | None,
    metrics_port: int | None = None,
) -> list[_Child]:
    """What ``conveyor up`` runs: a worker (with the relay), beat, the HTTP API on ``api``
    (host, port) and optionally Flower."""
    from conveyor.delivery.procs import service_env, start_worker

    settings = platform.settings
    queues = [q.name for q in platform.queues]

    def worker() -> subprocess.Popen[bytes]:
        return start_worker(
            settings,
            queues=queues,
            concurrency=concurrency,
            log_path=logs / "worker.log",
            die_with_parent=True,
            extra_args=["--metrics-port", str(metrics_port)] if metrics_port else (),
        )

    def beat() -> subprocess.Popen[bytes]:
        with open(logs / "beat.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", settings.app, "beat", "-l", "INFO"],
                env=service_env(settings),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=terminate_with_parent,
            )

    children = [_Child("worker", worker), _Child("beat", beat)]
    if api is not None:
        host, port = api

        def serve() -> subprocess.Popen[bytes]:
            with open(logs / "api.log", "ab") as out:
                return subprocess.Popen(
                    [sys.executable, "-m", "conveyor", "serve", "--host", host, "--port", str(port)],
                    env=service_env(settings),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=terminate_with_parent,
                )

        children.append(_Child("api", serve))
    if flower:
        # One password for the whole run: a restarted Flower must not invent a new one.
        password = settings.flower_password or secrets.token_urlsafe(12)
        if not settings.flower_password:
            console.print(f"Flower password [bold]{password}[/bold]")
        port = settings.flower_port
        children.append(_Child("flower", lambda: _flower_process(settings, port=port, password=password)))
    return children


def _wait_for_database(platform: Any) -> None:
    """Before migrating: a database that does not answer yet (an outage, a server still
    starting) is waited for, with a status line, never given up on."""
    from conveyor.cli.output import status
    from conveyor.delivery.startup import database_answers, database_at, wait_for

    engine = platform.engine
    wait_for(database_at(platform.settings.database_url), lambda: database_answers(engine), say=status)


def _stop_leftovers(home: Path) -> None:
    """A previous ``up`` of this home that was killed left its embedded Redis running (its
    other children got SIGTERM when it died): stop it before starting anew."""
    from urllib.parse import urlparse

    from conveyor.delivery.embedded import EmbeddedRedis
    from conveyor.runfile import pid_alive, stale_run

    stale = stale_run(home)
    if stale is None or not stale.redis_pid or not pid_alive(stale.redis_pid):
        return
    port = urlparse(stale.redis_url).port or 6379
    err.print(f"conveyor up: stopping the embedded Redis (pid {stale.redis_pid}) a killed run left")
    EmbeddedRedis(url=stale.redis_url, pid=stale.redis_pid, port=port).stop()


def _api_address(settings: ConveyorSettings, port: int | None) -> tuple[str, int] | None:
    """Where ``up`` serves the HTTP API, or None: port 0, or no web extra (said once).

    Raises:
        ConfigurationError: the port is taken (another ``up`` or server holds it).
    """
    port = settings.http_port if port is None else port
    if port == 0:
        return None
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        err.print("conveyor up: no HTTP API (install conveyor[web] for it)")
        return None
    host = settings.http_host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # As uvicorn binds: connections of a stopped server still in TIME_WAIT do not count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve the HTTP API on {host}:{port} ({exc.strerror}): "
                "pass --http-port N (0: no API) or set CONVEYOR_HTTP_PORT"
            ) from None
    return host, port


@cli.command()
def up(
    concurrency: int = typer.Option(None, help="worker pool size (default: setting)"),
    flower: bool = typer.Option(False, help="also run Flower (basic auth, read-only)"),
    http_port: int = typer.Option(
        None, help="the HTTP API's port (default: CONVEYOR_HTTP_PORT, 8000; 0: no API)"
    ),
    metrics_port: int = typer.Option(None, help="the worker's Prometheus metrics on this port"),
) -> None:
    """Run everything in one: services (embedded if unset), migrations, worker+relay, beat,
    and the HTTP API (with the web extra) on http://127.0.0.1:8000.

    A child that exits is restarted (after 1 s, doubling per quick exit, up to 60 s); Ctrl-C
    or SIGTERM stops everything.
    """

    def main() -> int:
        from conveyor.delivery.procs import stop
        from conveyor.delivery.services import attach, start_embedded
        from conveyor.runfile import RunInfo, claim_run, release_run

        base = ConveyorSettings()
        home = base.resolved_home()
        _stop_leftovers(home)
        services = attach(base) if base.redis_url and base.database_url else None
        services = services or start_embedded(base)
        info = RunInfo(
            pid=os.getpid(),
            redis_url=services.redis_url,
            database_url=services.database_url,
            started_at=time.time(),
            redis_pid=services.embedded_redis.pid if services.embedded_redis else None,
        )
        try:
            claim_run(home, info)
        except RuntimeError as exc:
            services.stop()
            err.print(f"[red]{exc}[/red]")
            return 2
        children: list[_Child] = []
        try:
            # After the claim: a second `up` of this home says it is running, not that its port is.
            api = _api_address(base, http_port)
            platform = load_platform(require_services=False)
            platform.bind(
                redis_url=services.redis_url, database_url=services.database_url, broker_url=base.broker_url
            )
            _wait_for_database(platform)
            migrate(platform)
            logs = home / "logs"
            logs.mkdir(exist_ok=True)
            children = _up_children(
                platform, logs, concurrency=concurrency, flower=flower, api=api, metrics_port=metrics_port
            )
            for child in children:
                child.start()
            console.print(
                f"[green]conveyor up[/green]: redis {shown_url(services.redis_url)} · "
                f"db {shown_url(services.database_url)}"
            )
            if api is not None:
                url = f"http://{api[0]}:{api[1]}"
                console.print(
                    f"HTTP API on {url} (console: {url}/console, docs: {url}/docs; a token: "
                    "conveyor tokens create --owner me --scope admin)"
                )
            console.print(f"logs in {logs}; Ctrl-C to stop")
            _supervise(children)
            return 0
        finally:
            for child in children:
                if child.proc is not None:
                    stop(child.proc)
            services.stop()
            release_run(home, os.getpid())

    run_command(main)


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    metrics_port: int = typer.Option(None, help="serve Prometheus metrics on this port"),
) -> None:
    """Run a Celery worker for the deployment (extra args go to ``celery worker``).

    Without ``-Q`` it consumes every queue the deployment declares (``task_queues``).

    Unlike a plain ``celery worker``, SIGTERM is bounded by ``CONVEYOR_SOFT_SHUTDOWN_TIMEOUT``:
    jobs still running at the deadline are requeued uncounted, then the worker exits.
    """

    def main() -> int:
        platform = load_platform()
        if metrics_port:
            from conveyor.metrics import serve
            from conveyor.upkeep.gauges import StateCollector

            state = StateCollector(platform.connections, [q.name for q in platform.queues])
            serve(metrics_port, str(platform.metrics.enable()), [state])
        from conveyor.worker.loop_probe import LoopTicks
        from conveyor.worker.shutdown import BoundedShutdown

        # `conveyor probe worker` reads what this step writes from the consumer's loop.
        platform.app.steps["consumer"].add(LoopTicks)

        BoundedShutdown(platform.connections, flow=platform.flow).install()
        # The bound replaces Celery's soft phase of a cold shutdown (SIGQUIT stays immediate).
        platform.app.conf.worker_soft_shutdown_timeout = 0
        argv = ["worker", "-l", "INFO", *ctx.args]
        named = any(a in ("-n", "--hostname") or a.startswith("--hostname=") for a in ctx.args)
        if platform.settings.broker_is_amqp() and not named:
            # Celery's default name (celery@host) is shared by every worker of a host, and on
            # RabbitMQ two workers of one name fight over its exclusive control queue forever.
            # A pid alone repeats across pid namespaces (every container's worker is pid 1).
            argv += ["-n", f"worker-{os.getpid()}-{secrets.token_hex(3)}@%h"]
        return run_celery(platform.app, argv)

    run_command(main)


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def beat(ctx: typer.Context) -> None:
    """Run celery beat (in-memory schedule state: no shelve file), once in the cluster: it
    fires only while it holds the beat lock (:mod:`conveyor.upkeep.beat_lock`); a second beat
    stands by until the first is gone."""

    def main() -> int:
        from conveyor.upkeep.beat_lock import BeatLock

        platform = load_platform()
        lock = BeatLock(platform.settings)
        lock.acquire()
        lock.watch()
        try:
            return run_celery(platform.app, ["beat", "-l", "INFO", *ctx.args])
        finally:
            lock.release()

    run_command(main)


def run_celery(app: Any, argv: list[str]) -> int:
    """Run ``celery <argv>`` for ``app`` and return its exit code (``Celery.start`` drops
    it, so a worker that stopped on an unrecoverable error would exit 0 and a supervisor
    restarting on failure only would not restart it)."""
    from celery.bin.celery import celery

    celery.params[0].default = app
    try:
        code = celery.main(args=argv, standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    finally:
        celery.params[0].default = None
    return code if isinstance(code, int) else 0


def _flower_process(
    settings: ConveyorSettings, *, port: int, password: str | None = None, address: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    """Flower, read-only, behind basic auth, never persistent (its state file pickles).

    The credentials travel in the environment, not on the command line (``ps`` shows
    arguments to every local user); ``FLOWER_*`` variables and ``flowerconfig.py`` files
    are ignored so nothing can switch persistence or control back on.
    """
    from conveyor.delivery.procs import service_env

    chosen = password or settings.flower_password
    password = chosen or secrets.token_urlsafe(12)
    shown = f" password [bold]{password}[/bold]" if not chosen else ""
    console.print(f"Flower on http://{address}:{port} user [bold]{settings.flower_user}[/bold]{shown}")
    env = {k: v for k, v in service_env(settings).items() if not k.startswith("FLOWER_")}
    env["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    home = settings.resolved_home()
    conf = home / "flowerconfig.py"
    conf.write_text("# Written by conveyor: Flower's options come from `conveyor flower` only.\n")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            settings.app,
            "flower",
            f"--port={port}",
            f"--address={address}",
            "--read_only=True",
            "--persistent=False",
            f"--conf={conf}",
        ],
        env=env,
        cwd=home,
        start_new_session=True,
        preexec_fn=terminate_with_parent,  # `conveyor flower` or `up` gone: Flower too
    )


@cli.command()
def flower(
    port: int = typer.Option(None, help="port (default: setting)"),
    password: str = typer.Option(None, help="basic-auth password (default: setting or random)"),
    address: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 in a container)"),
) -> None:
    """Run Flower, read-only and behind basic auth (never ``--persistent``: it pickles)."""

    def main() -> int:
        from conveyor.delivery.procs import stop

        platform = load_platform()
        proc = _flower_process(
            platform.settings, port=port or platform.settings.flower_port, password=password, address=address
        )
        signal.signal(signal.SIGTERM, lambda *_: stop(proc))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return stop(proc)

    run_command(main)


@cli.command()
def demo(
    jobs: int = typer.Option(300, help="number of plain self-check jobs"),
    concurrency: int = typer.Option(2, help="worker pool size"),
) -> None:
    """Self-check: push a few hundred jobs through a real worker and assert the outcome."""

    def main() -> int:
        from conveyor.delivery.procs import start_worker, stop
        from conveyor.delivery.services import attach, start_embedded

        base = ConveyorSettings()
        services = attach(base)
        attached = services is not None
        services = services or start_embedded(base)
        proc = None
        try:
            platform = load_platform(require_services=False)
            platform.bind(
                redis_url=services.redis_url, database_url=services.database_url, broker_url=base.broker_url
            )
            _wait_for_database(platform)
            migrate(platform)
            own_worker = not attached or bool(base.redis_url and base.database_url)
            # The families' local peers, named in the worker's environment: only a worker
            # the demo starts can be told where they are.
            hook = platform.settings.demo_peers
            peers = import_path(hook)() if hook and own_worker else contextlib.nullcontext({})
            with peers as peer_env:
                if own_worker:
                    logs = platform.settings.resolved_home() / "logs"
                    logs.mkdir(exist_ok=True)
                    proc = start_worker(
                        platform.settings,
                        queues=[q.name for q in platform.queues],
                        concurrency=concurrency,
                        log_path=logs / "demo-worker.log",
                        extra_env={
                            "CONVEYOR_RELAY_INTERVAL": "0.2",
                            "CONVEYOR_RECONCILER_INTERVAL": "1",
                            **dict(peer_env),
                        },
                    )
                check = import_path(platform.settings.demo)
                ok = check(platform, console, jobs=jobs)
                if proc is not None:
                    stop(proc)
                    proc = None
            return 0 if ok else 1
        finally:
            if proc is not None:
                stop(proc)
            services.stop()

    run_command(main)
