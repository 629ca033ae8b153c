"""A router for the caller's own Celery app: ``send_task`` by stage name reaches the stage.

A plain Celery app sends a task it has no route for to its default queue, ``celery``,
which Conveyor's workers do not consume unless asked to (``CONVEYOR_CONSUME_DEFAULT_QUEUE``).
This router sends each stage's messages to the stage's queue, read from the stage
registry (the ``stages`` table that ``conveyor db upgrade`` and every worker write)::

    from celery import Celery
    from conveyor.contrib.celery import router

    app = Celery(broker=REDIS_URL, backend=REDIS_URL)   # the deployment's Redis
    app.conf.task_routes = (router(),)                  # its client: conveyor.connect()
    app.send_task("conveyor.demo.square", kwargs={"n": 7}).get(timeout=30)   # {"n": 49}

A name in a namespace the registry owns (the first dotted part of a registered stage's
name: ``conveyor.``) that is not a stage, nor a task of the caller's own app, raises
:class:`conveyor.UnknownStage` naming the close stages: no message is sent where no worker
reads. Other names get no route from it (Celery's next router, or its default queue). The
worker makes the message a job whose id is the task id. This module is client-side: it
imports nothing of the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kombu.entity import Exchange, Queue

import conveyor
from conveyor.client import registry
from conveyor.client.by_name import Client
from conveyor.client.registry import RegisteredStage
from conveyor.errors import UnknownStage, describe
from conveyor.settings import ConveyorSettings

log = logging.getLogger("conveyor.contrib.celery")


class StageRouter:
    """A Celery router (``task_routes`` entry) built from the stage registry.

    The registry is read at the first call and again at most every ``ttl`` seconds; a
    read that fails keeps the stages known so far (and is logged), so a database outage
    never fails or slows a ``send_task`` for more than one attempt per ``ttl``. A name in
    one of ``namespaces`` (default: the registered stages' first dotted parts) that is no
    stage is looked up once more, then refused with :class:`UnknownStage`.
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        ttl: float = 30.0,
        namespaces: Iterable[str] | None = None,
        settings: ConveyorSettings | None = None,
    ) -> None:
        self._client = client
        self._settings = settings
        self.ttl = ttl
        self.namespaces = None if namespaces is None else frozenset(n.rstrip(".") for n in namespaces)
        self._stages: dict[str, RegisteredStage] = {}
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """The client the registry is read through, made at first use: a router built at
        import (a Django project's ``celery_app.py``) connects once the settings are set up."""
        with self._lock:
            if self._client is None:
                self._client = conveyor.connect(self._settings)
            return self._client

    def __call__(
        self,
        name: str,
        args: Any = None,
        kwargs: Any = None,
        options: Mapping[str, Any] | None = None,
        task: Any = None,
        **_: Any,
    ) -> dict[str, Any] | None:
        """The route of task ``name``: its stage's queue, or None for other tasks.

        Raises :class:`UnknownStage` for a name in the registry's namespaces that neither
        it nor the caller's app (``task``) knows."""
        queue = self.queues().get(name)
        if queue is None and task is None and self._owned(name):
            queue = self._registered_since(name)
        if queue is None:
            return None
        # Straight into the queue (the default exchange), as conveyor's own client
        # publishes: the app need not know the queue, and declares nothing. The workers
        # declare it; on RabbitMQ a declaration without its arguments (quorum) would fail.
        return {"queue": Queue(queue, Exchange(""), routing_key=queue, no_declare=True)}  # type: ignore[no-untyped-call]

    def queues(self) -> dict[str, str]:
        """Each registered stage's queue, by stage name."""
        return {name: stage.queue for name, stage in self._known().items()}

    def _known(self) -> dict[str, RegisteredStage]:
        client = self.client
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at >= self.ttl:
                self._checked_at = now
                try:
                    self._stages = client.stages(refresh=True)
                except Exception as exc:
                    log.warning(
                        "could not read the stage registry (%s); routing by the %d stages known, "
                        "trying again in %g s",
                        describe(exc),
                        len(self._stages),
                        self.ttl,
                    )
            return dict(self._stages)

    def _owned(self, name: str) -> bool:
        """Whether ``name`` is in a namespace only the registry names tasks in."""
        owned = self.namespaces
        if owned is None:
            owned = frozenset(n.split(".", 1)[0] for n in self._known() if "." in n)
        return "." in name and name.split(".", 1)[0] in owned

    def _registered_since(self, name: str) -> str:
        """``name``'s queue if a worker registered it since the last read; else
        :class:`UnknownStage` with the close names."""
        try:
            found = self.client.stage(name)  # reads the registry again before refusing
        except UnknownStage:
            raise
        except Exception as exc:
            log.warning("could not read the stage registry (%s) for %r", describe(exc), name)
            found = registry.lookup(self._known(), name)
        with self._lock:
            self._stages[name] = found
        return found.queue


def router(
    source: Client | ConveyorSettings | None = None,
    *,
    ttl: float = 30.0,
    namespaces: Iterable[str] | None = None,
) -> StageRouter:
    """A router for ``app.conf.task_routes`` that sends each stage's tasks to its queue.

    ``source`` is a :class:`conveyor.Client` (``conveyor.connect()``), or settings to
    make one from; without it, ``conveyor.connect()`` at the first ``send_task`` (the
    environment, or a Django project's ``settings.CONVEYOR`` and ``DATABASES``).
    ``namespaces``: the first dotted parts of names that must be stages (default: those of
    the registered stages; ``()`` refuses none).
    """
    if isinstance(source, Client):
        return StageRouter(source, ttl=ttl, namespaces=namespaces)
    return StageRouter(settings=source, ttl=ttl, namespaces=namespaces)


__all__ = ["StageRouter", "router"]
