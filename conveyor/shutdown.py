"""A SIGTERM that ends within ``soft_shutdown_timeout`` (``conveyor worker``, ``conveyor up``).

Celery's SIGTERM is a warm shutdown that waits for running jobs however long they take;
``worker_soft_shutdown_timeout`` only bounds a *cold* shutdown, and after a cold shutdown
pool children die by their parent-death signal, so their jobs look crashed and the next
attempt counts. Conveyor's bound: when a warm shutdown starts, a thread in the worker's
main process waits up to the timeout for the running jobs; at the deadline it requeues
each job still running, uncounted ("shutdown"), in Postgres, *then* kills the pool child
running it, and the warm shutdown completes at once. The requeue is a compare-and-set on
the child's lease owner, so a job that finished in the meantime is left alone, and a
late write of the killed attempt is refused by its fencing token. A solo or thread pool
runs its jobs in the worker's own process: they are requeued the same way and the
process exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

from celery import signals
from celery.worker import state as worker_state
from sqlalchemy import or_, select

from conveyor.broker import JOB_HEADER
from conveyor.connections import Connections
from conveyor.db import schema as s
from conveyor.db.schema import jobs
from conveyor.flow import Flow
from conveyor.runfile import owner_id

log = logging.getLogger("conveyor.shutdown")


def request_job_id(request: Any) -> str | None:
    """The Conveyor job id a Celery worker request carries (None for plain tasks)."""
    headers = getattr(request, "_request_dict", None) or {}
    value = headers.get(JOB_HEADER)
    if value is None:
        value = (headers.get("headers") or {}).get(JOB_HEADER)
    return str(value) if value else None


class BoundedShutdown:
    """Installed by ``conveyor worker``: see the module docs."""

    def __init__(self, connections: Connections, *, flow: Flow) -> None:
        self.connections = connections
        self.flow = flow
        self._started = False

    def install(self) -> None:
        """Listen for the worker's warm shutdown."""
        signals.worker_shutting_down.connect(self._on_shutting_down, weak=False)

    def _on_shutting_down(self, sig: str = "", how: str = "", **_: Any) -> None:
        if how != "Warm" or self._started:
            return
        self._started = True
        threading.Thread(target=self._watch, name="conveyor-shutdown", daemon=True).start()

    def _watch(self) -> None:
        timeout = self.connections.settings.soft_shutdown_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not worker_state.active_requests:
                return
            time.sleep(0.1)
        self.cut_short(list(worker_state.active_requests))

    def cut_short(self, requests: list[Any]) -> None:
        """Requeue the jobs of ``requests`` uncounted, then kill the children running them.

        A solo or thread pool runs its jobs in this very process: they are requeued by
        their lease owners (this process, any thread) and the process exits at once.
        """
        in_process = False
        for request in requests:
            pid = getattr(request, "worker_pid", None)
            if not pid or pid == os.getpid():
                in_process = True
                continue
            job_id = request_job_id(request)
            if job_id is not None:
                self._requeue(job_id, owner_id(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if in_process:
            for job_id, owner in self._own_running_jobs():
                self._requeue(job_id, owner)
            log.warning("shutdown deadline: exiting with jobs of this process requeued")
            logging.shutdown()
            os._exit(0)

    def _requeue(self, job_id: str, owner: str) -> None:
        try:
            outcome = self.flow.requeue_uncounted(job_id, None, owner, "shutdown")
        except Exception:
            # The database is out of reach: the lease expires and the reconciler takes the
            # job over (that attempt counts, as any crash does).
            log.warning("shutdown deadline: could not requeue job %s", job_id, exc_info=True)
            return
        if outcome == "released":
            log.warning("shutdown deadline: job %s requeued uncounted", job_id)

    def _own_running_jobs(self) -> list[tuple[str, str]]:
        """(job id, lease owner) of the jobs this process runs: its main thread's and its
        pool threads' (``node:pid`` and ``node:pid:thread``)."""
        me = owner_id()
        with self.connections.engine.connect() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.lease_owner).where(
                    jobs.c.status == s.RUNNING,
                    or_(jobs.c.lease_owner == me, jobs.c.lease_owner.like(f"{me}:%")),
                )
            ).all()
        return [(str(r.id), str(r.lease_owner)) for r in rows]


__all__ = ["BoundedShutdown", "request_job_id"]
