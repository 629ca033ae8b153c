"""A SIGTERM that ends within ``soft_shutdown_timeout`` (``conveyor worker``, ``conveyor up``).

Celery's SIGTERM is a warm shutdown that waits for running jobs however long they take;
``worker_soft_shutdown_timeout`` only bounds a *cold* shutdown, and after a cold shutdown
pool children die by their parent-death signal, so their jobs look crashed and the next
attempt counts. Conveyor's bound: when a warm shutdown starts, a thread in the worker's
main process waits up to the timeout for the running jobs; at the deadline it requeues
each job still running, uncounted ("shutdown"), in Postgres, *then* kills the pool child
running it, and the warm shutdown completes at once. The jobs are found by their lease
owner (the child's ``node:pid``), so a job adopted from a plain Celery message, which
carries no job header, is requeued as a submitted one is. The requeue is a
compare-and-set on the child's lease owner, so a job that finished in the meantime is
left alone, and a late write of the killed attempt is refused by its fencing token. A solo or thread pool
runs its jobs in the worker's own process: they are requeued the same way and the
process exits at once.

*A SIGTERM to the whole process group* (honcho, systemd's default ``KillMode``, ``kill
-TERM -PGID``) reaches the pool children too, where billiard ends the running job at once.
The main process notes the moment it takes a SIGTERM as a warm shutdown in memory it
shares with its children (mapped before they fork); a child that gets a SIGTERM waits up
to ``GROUP_SIGTERM_WINDOW`` for such a note and, finding one from about the same moment,
ignores its own: the job runs on, and the main process's deadline decides. Any other
SIGTERM into a child (a cold shutdown, ``revoke(terminate=True)``) ends its job as before,
that much later.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import signal
import threading
import time
from typing import Any

from celery import signals
from celery.worker import state as worker_state
from sqlalchemy import or_, select

from conveyor.delivery.broker import JOB_HEADER
from conveyor.delivery.connections import Connections
from conveyor.runfile import owner_id
from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from conveyor.worker.flow import Flow

log = logging.getLogger("conveyor.shutdown")

# How far apart the main process's SIGTERM and a child's may be to count as one signal to
# the process group; a child waits this long for the main process's note (a loaded machine
# may run the main process's handler late).
GROUP_SIGTERM_WINDOW = 2.0


class _TermClock:
    """When the main process last took a SIGTERM as a warm shutdown (``time.monotonic``:
    one clock for every process of the machine), in an anonymous shared mapping that pool
    children forked after it see."""

    def __init__(self) -> None:
        self.main_pid = os.getpid()
        self._map = mmap.mmap(-1, ctypes.sizeof(ctypes.c_double))
        self._value = ctypes.c_double.from_buffer(self._map)
        self._installed_in = 0

    def note(self) -> None:
        """In the main process: a SIGTERM starts a warm shutdown now."""
        self._value.value = time.monotonic()

    def matches(self, received: float) -> bool:
        """Whether the main process noted a SIGTERM within the window of ``received``."""
        noted = self._value.value
        return noted > 0 and abs(noted - received) <= GROUP_SIGTERM_WINDOW

    def guard_child(self, **_: Any) -> None:
        """In a pool child's main thread, before each task (``task_prerun``): make its
        SIGTERM wait for the main process's verdict (billiard installs its own handler
        after ``worker_process_init``, hence this late and once per process)."""
        pid = os.getpid()
        if (
            pid in (self.main_pid, self._installed_in)
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        self._installed_in = pid
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            received = time.monotonic()
            while not self.matches(received):
                if time.monotonic() - received >= GROUP_SIGTERM_WINDOW or os.getppid() != self.main_pid:
                    _handle_as(previous, signum, frame)
                    return
                time.sleep(0.01)
            # The same SIGTERM as the main process's: its bounded shutdown decides.

        signal.signal(signal.SIGTERM, on_sigterm)


def _handle_as(handler: Any, signum: int, frame: Any) -> None:
    """Do what ``handler`` (a previous ``signal.getsignal``) would have done."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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
        self._clock: _TermClock | None = None

    def install(self) -> None:
        """Listen for the worker's warm shutdown (before the pool's children fork)."""
        self._clock = _TermClock()
        signals.worker_shutting_down.connect(self._on_shutting_down, weak=False)
        signals.task_prerun.connect(self._clock.guard_child, weak=False)

    def _on_shutting_down(self, sig: str = "", how: str = "", **_: Any) -> None:
        if how == "Warm" and sig == "SIGTERM" and self._clock is not None:
            self._clock.note()
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
        children: list[int] = []
        for request in requests:
            pid = getattr(request, "worker_pid", None)
            if not pid or pid == os.getpid():
                in_process = True
            else:
                children.append(pid)
        # Found by the lease owner each claim wrote, not by the message: a plain Celery
        # message (``send_task`` by name) carries no job header; its job is made at adoption.
        for job_id, owner in self._running_jobs([owner_id(pid) for pid in children]):
            self._requeue(job_id, owner)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if in_process:
            for job_id, owner in self._running_jobs([], this_process=True):
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

    def _running_jobs(self, owners: list[str], *, this_process: bool = False) -> list[tuple[str, str]]:
        """(job id, lease owner) of the running jobs of ``owners`` (pool children:
        ``node:pid``) or, with ``this_process``, of this process's main thread and pool
        threads (``node:pid`` and ``node:pid:thread``). None with the database out of
        reach: their leases expire and they are taken over (counted, as after a crash)."""
        if not this_process and not owners:
            return []
        me = owner_id()
        owned = (
            or_(jobs.c.lease_owner == me, jobs.c.lease_owner.like(f"{me}:%"))
            if this_process
            else jobs.c.lease_owner.in_(owners)
        )
        try:
            with self.connections.engine.connect() as conn:
                rows = conn.execute(
                    select(jobs.c.id, jobs.c.lease_owner).where(jobs.c.status == s.RUNNING, owned)
                ).all()
        except Exception:
            log.warning("shutdown deadline: could not read the running jobs", exc_info=True)
            return []
        return [(str(r.id), str(r.lease_owner)) for r in rows]


__all__ = ["BoundedShutdown", "request_job_id"]
