"""Worker integration: start-up checks, the relay thread, fork hygiene, garbage handling."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.control import control_command

from conveyor.errors import ConfigurationError
from conveyor.relay import Relay

if TYPE_CHECKING:
    from conveyor.platform import Platform

log = logging.getLogger("conveyor.worker")


def check_redis_policy(platform: Platform) -> None:
    """Refuse to run unless Redis will never evict keys (kombu's bindings included)."""
    info = platform.redis.info("memory")
    policy = str(info.get("maxmemory_policy", "unknown"))
    if policy != "noeviction":
        raise ConfigurationError(
            f"Redis maxmemory-policy is {policy!r}; Conveyor requires 'noeviction' because an "
            "evicted queue binding makes kombu drop messages silently. Fix it with "
            "`CONFIG SET maxmemory-policy noeviction` (and in redis.conf)."
        )


class ConveyorStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Checks Redis at start and runs the relay/reconciler thread in the main process."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.platform: Platform = worker.app.conveyor
        self.relay: Relay | None = None

    def start(self, worker: Any) -> None:
        check_redis_policy(self.platform)
        self.platform.broker.epoch(max_age=0)
        self.relay = Relay(self.platform)
        self.relay.start()
        self.platform.background.append(self.relay)

    def stop(self, worker: Any) -> None:
        if self.relay is not None:
            self.relay.stop()

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer, except that unrunnable messages go to the DLQ without their body.

    Celery's own handlers log the full message body, which may hold personal data.
    """

    def _garbage(self, message: Any, error_type: str, text: str) -> None:
        headers = dict(getattr(message, "headers", None) or {})
        headers["content_type"] = getattr(message, "content_type", None)
        headers["content_encoding"] = getattr(message, "content_encoding", None)
        try:
            self.app.conveyor.runner.record_garbage(error_type, text, headers)
        except Exception:
            log.warning("could not record a rejected message in the DLQ", exc_info=True)
        log.error("rejected message (%s): %s; headers recorded in the DLQ, body discarded", error_type, text)

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._garbage(message, "UnknownMessage", "message is not a Celery task message")
        message.reject_log_error(log, self.connection_errors)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        name = (getattr(message, "headers", None) or {}).get("task", "?")
        self._garbage(message, "UnknownTask", f"no stage named {str(name)[:200]!r} is registered")
        message.reject_log_error(log, self.connection_errors)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._garbage(message, type(exc).__name__, f"invalid task message: {str(exc)[:300]}")
        message.reject_log_error(log, self.connection_errors)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._garbage(message, "DecodeError", f"message body could not be decoded: {str(exc)[:300]}")
        message.ack()


@control_command(  # type: ignore[untyped-decorator]
    args=[("job_id", str), ("attempt", int), ("task_id", str)],
    signature="<job_id> <attempt> <task_id>",
)
def conveyor_interrupt(state: Any, job_id: str, attempt: int, task_id: str) -> dict[str, str]:
    """Escalation for a job asked to stop that reached no checkpoint: signal the pool
    child running exactly this delivery (SIGUSR1); the child raises only if its current
    job and attempt carry the stop request. Never ``revoke(terminate=True)``: by then the
    process may be running another task."""
    for request in list(worker_state.active_requests):
        if request.id == task_id and request.worker_pid:
            os.kill(request.worker_pid, signal.SIGUSR1)
            return {"ok": f"signalled {request.worker_pid} for {job_id}#{attempt}"}
    return {"ok": "not running here"}


def install(platform: Platform) -> None:
    """Wire the platform into its Celery app's workers."""
    app = platform.app
    app.steps["worker"].add(ConveyorStep)
    app.conf.worker_consumer = "conveyor.worker:Consumer"

    def _reset_after_fork(**_: Any) -> None:
        # Pool children must not share the parent's sockets (SQLAlchemy pool, Redis).
        platform.reset()

    signals.worker_process_init.connect(_reset_after_fork, weak=False)
