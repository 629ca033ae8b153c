"""Worker integration: start-up checks, the relay thread, fork hygiene, garbage handling."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from celery import Celery, bootsteps, signals
from celery.utils.log import get_multiprocessing_logger
from celery.worker import state as worker_state
from celery.worker.control import control_command
from redis import Redis

from conveyor import tracing
from conveyor.client import registry
from conveyor.delivery import transport
from conveyor.delivery.broker import JOB_HEADER
from conveyor.delivery.celeryconfig import celery_default_queue
from conveyor.delivery.connections import Connections
from conveyor.delivery.startup import (
    database_answers,
    database_at,
    quick_redis,
    redis_at,
    redis_outage,
    wait_for,
)
from conveyor.errors import ConfigurationError
from conveyor.logs import configure_logging
from conveyor.runfile import owner_id
from conveyor.settings import ConveyorSettings
from conveyor.stage import StageSpec
from conveyor.store.liveness import Deliveries
from conveyor.worker.heartbeat import INTERRUPT_SIGNAL, Heartbeat
from conveyor.worker.loop_probe import ticker
from conveyor.worker.shutdown import request_job_id

log = logging.getLogger("conveyor.worker")


class Background(Protocol):
    """A thread of the main process the step starts and stops: the relay (and reconciler),
    which is the upkeep side's, handed over by the platform."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Configured(Protocol):
    """Whatever carries the settings (the platform)."""

    @property
    def settings(self) -> ConveyorSettings: ...


class Host(Configured, Protocol):
    """What the worker integration needs of the platform that installs it
    (:class:`conveyor.platform.Platform`, found as ``app.conveyor`` by the bootstep)."""

    @property
    def app(self) -> Celery: ...

    @property
    def connections(self) -> Connections: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    @property
    def deliveries(self) -> Deliveries: ...

    @property
    def stages(self) -> Mapping[str, StageSpec]: ...

    @property
    def background(self) -> list[Any]: ...

    def relay(self) -> Background:
        """A new relay (and reconciler)."""
        ...

    def reset(self) -> None:
        """Forget this process's connections (after a fork)."""
        ...


def check_redis_policy(redis: Redis) -> None:
    """Refuse to run unless Redis will never evict keys (kombu's bindings included)."""
    info = redis.info("memory")
    policy = str(info.get("maxmemory_policy", "unknown"))
    if policy != "noeviction":
        raise ConfigurationError(
            f"Redis maxmemory-policy is {policy!r}; Conveyor requires 'noeviction' because an "
            "evicted queue binding makes kombu drop messages silently. Fix it with "
            "`CONFIG SET maxmemory-policy noeviction` (and in redis.conf)."
        )


class ConveyorStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Waits at start for Redis and Postgres (:mod:`conveyor.delivery.startup`), refuses a Redis that
    may evict keys, and runs the relay/reconciler thread in the main process."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.host: Host = worker.app.conveyor
        self.relay: Background | None = None
        # Celery's node name may repeat across hosts (``celery@<hostname>``, pods sharing
        # a name, pid 1 in each container): the lease owner's node keeps it unique.
        self.worker_id = f"{worker.hostname}:{owner_id()}"
        self._record: Any = None
        if self.host.settings.consume_default_queue:
            # After the worker chose its queues (-Q or all declared): one more, as with -Q.
            worker.app.amqp.queues.select_add(celery_default_queue())

    def start(self, worker: Any) -> None:
        host = self.host
        settings, connections = host.settings, host.connections
        tick = ticker(worker.app)

        def each_second(status: str) -> None:
            if tick is not None:
                with contextlib.suppress(OSError):
                    tick(status)
            worker_state.maybe_shutdown()  # a SIGTERM while waiting ends the wait

        def redis_policy() -> None:
            url = settings.redis_url
            client = quick_redis(url) if url else connections.redis  # unset: NotRunning
            try:
                check_redis_policy(client)
            finally:
                client.close()

        # An outage at start is waited for; a Redis that may evict keys is still refused.
        wait_for(redis_at(settings.redis_url), redis_policy, outage=redis_outage, each_second=each_second)
        # Callers that submit by name validate against what the workers run.
        host.app.loader.import_default_modules()
        wait_for(
            database_at(settings.database_url),
            lambda: database_answers(connections.engine),
            each_second=each_second,
        )
        registry.refresh(connections.engine, host.stages.values())
        # A stray interrupt must never end the worker itself (SIGUSR2's default action).
        host.heartbeat.install_interrupt_handler()
        try:
            host.connections.broker.epoch(max_age=0)
        except Exception as exc:  # the broker is still booting: Celery's consumer keeps trying
            log.warning(
                "broker epoch not read at start (%r): the relay reads it when the broker answers", exc
            )
        deliveries = host.deliveries
        try:
            deliveries.beat(self.worker_id)
        except Exception as exc:  # Redis gone again since it answered: the beat thread retries
            log.warning("first liveness beat not written (%r); the beat thread retries", exc)
        deliveries.start(self.worker_id)
        worker_id = self.worker_id

        if worker.app.conf.broker_transport == transport.NAME:
            # Noted with kombu's own unacked bookkeeping, in one round trip.
            transport.record_deliveries(deliveries.taken_key(worker_id), JOB_HEADER)
        else:

            def record(sender: Any = None, request: Any = None, **_: Any) -> None:
                job_id = request_job_id(request)
                if job_id is not None:
                    try:
                        deliveries.record(worker_id, job_id)
                    except Exception:  # Redis down: the message is lost with us only if we die too
                        log.debug("could not record delivery of %s", job_id, exc_info=True)

            self._record = record
            signals.task_received.connect(record, weak=False)
        self.relay = host.relay()
        self.relay.start()
        host.background.append(self.relay)

    def stop(self, worker: Any) -> None:
        if self.relay is not None:
            self.relay.stop()
        transport.record_deliveries(None)
        if self._record is not None:
            signals.task_received.disconnect(self._record)
            self._record = None
        self.host.deliveries.stop(self.worker_id)

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


@control_command(  # type: ignore[untyped-decorator]
    args=[("job_id", str), ("attempt", int), ("task_id", str)],
    signature="<job_id> <attempt> <task_id>",
)
def conveyor_interrupt(state: Any, job_id: str, attempt: int, task_id: str) -> dict[str, str]:
    """Escalation for a job asked to stop that reached no checkpoint: signal the pool
    child running exactly this job's delivery (SIGUSR2, see ``conveyor.worker.heartbeat``); the
    child raises only if the job and attempt it runs now carry a stop request. Never
    ``revoke(terminate=True)``: by then the process may be running another task."""
    for request in list(worker_state.active_requests):
        if request_job_id(request) == job_id and request.id == task_id and request.worker_pid:
            if request.worker_pid == os.getpid():
                # A solo or thread pool runs the job in this very process, and a signal
                # cannot choose its thread: the job stops at its next checkpoint (its stop
                # request is read from Postgres), or runs to its end.
                return {"ok": f"{job_id}#{attempt} runs in the worker process; left to its checkpoints"}
            os.kill(request.worker_pid, INTERRUPT_SIGNAL)
            return {"ok": f"signalled {request.worker_pid} for {job_id}#{attempt}"}
    return {"ok": "not running here"}


def use_conveyor_logging(platform: Configured) -> Callable[[], None]:
    """Make Celery programs (worker, beat) log through :func:`conveyor.logs.configure_logging`.

    A receiver of ``setup_logging`` makes Celery skip its own logging setup entirely. The
    level is ``CONVEYOR_LOG_LEVEL`` when set, else the program's ``-l``. Returns a function
    that disconnects the receivers again.
    """

    def setup(loglevel: Any = None, logfile: Any = None, **_: Any) -> None:
        settings = platform.settings
        explicit = "log_level" in settings.model_fields_set
        level = settings.log_level if explicit or not loglevel else loglevel
        # As Celery does: sys.stderr may already be redirected to a logger.
        stream = logfile if hasattr(logfile, "write") else (sys.__stderr__ or sys.stderr)
        path = logfile if isinstance(logfile, str) and logfile else None
        configure_logging(settings, level=level, stream=stream, logfile=path)
        # Celery's own setup is what usually turns billiard's logger on; without it the
        # pool's "Process ... exited with ..." errors would be dropped.
        pool_log = get_multiprocessing_logger()
        if pool_log is not None:
            pool_log.propagate = True
            pool_log.setLevel(logging.getLogger().level if os.environ.get("MP_LOG") else logging.ERROR)

    def redirect_stdouts(sender: Any = None, instance: Any = None, **_: Any) -> None:
        # Celery skips this when logging is customised; without it a stage's print() would
        # bypass the renderer and the redaction (pool children follow the parent's choice).
        if getattr(instance, "_custom_logging", None) and getattr(instance, "redirect_stdouts", False):
            instance.app.log.redirect_stdouts(instance.redirect_stdouts_level)

    signals.setup_logging.connect(setup, weak=False)
    signals.celeryd_after_setup.connect(redirect_stdouts, weak=False)

    def disconnect() -> None:
        signals.setup_logging.disconnect(setup)
        signals.celeryd_after_setup.disconnect(redirect_stdouts)

    return disconnect


def install(platform: Host) -> None:
    """Wire the platform into its Celery app's workers."""
    app = platform.app
    use_conveyor_logging(platform)
    app.steps["worker"].add(ConveyorStep)
    app.conf.worker_consumer = "conveyor.worker.consumer:Consumer"

    def _reset_after_fork(**_: Any) -> None:
        # Pool children must not share the parent's sockets (SQLAlchemy pool, Redis).
        platform.reset()
        # Before any job: SIGUSR2's default action would end the child.
        platform.heartbeat.install_interrupt_handler()

    signals.worker_process_init.connect(_reset_after_fork, weak=False)
    install_tracing(platform)


def install_tracing(platform: Configured) -> Callable[[], None]:
    """Tracing in a worker (:mod:`conveyor.tracing`): the job a task ran is forgotten when
    it ends; with ``CONVEYOR_TRACING=on`` each pool child (``worker_process_init``: an
    exporter's thread never survives a fork) or a solo/threads worker itself installs
    the SDK and the Celery instrumentation. Returns a function that disconnects them."""
    signals.task_postrun.connect(tracing.clear_job_context, weak=False)

    def in_child(**_: Any) -> None:
        tracing.configure(platform.settings)

    def in_worker(sender: Any = None, **_: Any) -> None:
        pool = getattr(sender, "pool_cls", None)
        name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
        if "prefork" not in str(name):  # no pool children: this process runs the tasks
            tracing.configure(platform.settings)

    if platform.settings.tracing == "on":
        signals.worker_process_init.connect(in_child, weak=False)
        signals.worker_init.connect(in_worker, weak=False)

    def disconnect() -> None:
        signals.worker_process_init.disconnect(in_child)
        signals.worker_init.disconnect(in_worker)

    return disconnect
