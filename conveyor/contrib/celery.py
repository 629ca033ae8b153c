"""A router for the caller's own Celery app: ``send_task`` by stage name reaches the stage.

A plain Celery app sends a task it has no route for to its default queue, ``celery``,
which Conveyor's workers do not consume unless asked to (``CONVEYOR_CONSUME_DEFAULT_QUEUE``).
This router sends each stage's messages to the stage's queue, read from the stage
registry (the ``stages`` table that ``conveyor db upgrade`` and every worker write)::

    from celery import Celery
    import conveyor
    from conveyor.contrib.celery import router

    app = Celery(broker=REDIS_URL, backend=REDIS_URL)   # the deployment's Redis
    app.conf.task_routes = (router(conveyor.connect()),)
    app.send_task("conveyor.demo.square", kwargs={"n": 7}).get(timeout=30)   # {"n": 49}

Names that are not stages get no route from it (Celery's next router, or its default
queue). The worker makes the message a job whose id is the task id. This module is
client-side: it imports nothing of the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from kombu.entity import Exchange, Queue

from conveyor.client import Client
from conveyor.errors import describe
from conveyor.settings import ConveyorSettings

log = logging.getLogger("conveyor.contrib.celery")


class StageRouter:
    """A Celery router (``task_routes`` entry) built from the stage registry.

    The registry is read at the first call and again at most every ``ttl`` seconds; a
    read that fails keeps the stages known so far (and is logged), so a database outage
    never fails or slows a ``send_task`` for more than one attempt per ``ttl``.
    """

    def __init__(self, client: Client, *, ttl: float = 30.0) -> None:
        self.client = client
        self.ttl = ttl
        self._queues: dict[str, str] = {}
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    def __call__(
        self,
        name: str,
        args: Any = None,
        kwargs: Any = None,
        options: Mapping[str, Any] | None = None,
        task: Any = None,
        **_: Any,
    ) -> dict[str, Any] | None:
        """The route of task ``name``: its stage's queue, or None for other tasks."""
        queue = self.queues().get(name)
        if queue is None:
            return None
        # Straight into the queue (the default exchange), as conveyor's own client
        # publishes: the app need not know the queue, and declares nothing. The workers
        # declare it; on RabbitMQ a declaration without its arguments (quorum) would fail.
        return {"queue": Queue(queue, Exchange(""), routing_key=queue, no_declare=True)}  # type: ignore[no-untyped-call]

    def queues(self) -> dict[str, str]:
        """Each registered stage's queue, by stage name."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at >= self.ttl:
                self._checked_at = now
                try:
                    stages = self.client.stages(refresh=True)
                    self._queues = {name: stage.queue for name, stage in stages.items()}
                except Exception as exc:
                    log.warning(
                        "could not read the stage registry (%s); routing by the %d stages known, "
                        "trying again in %g s",
                        describe(exc),
                        len(self._queues),
                        self.ttl,
                    )
            return dict(self._queues)


def router(source: Client | ConveyorSettings | None = None, *, ttl: float = 30.0) -> StageRouter:
    """A router for ``app.conf.task_routes`` that sends each stage's tasks to its queue.

    ``source`` is a :class:`conveyor.Client` (``conveyor.connect()``), or settings to
    make one from (default: the environment, ``CONVEYOR_DATABASE_URL``).
    """
    client = source if isinstance(source, Client) else Client(source)
    return StageRouter(client, ttl=ttl)


__all__ = ["StageRouter", "router"]
