"""What runs beside a stage body in its process: lease renewal, stop requests, interrupts.

One daemon thread per process renews the running job's lease, reads its stop request
(the Redis fast flag often, Postgres at least every ``preempt_grace / 2``, so a request
whose fast flag was lost is still seen in time) and flushes requeues that an outage
delayed.

The escalation of a stop request that no checkpoint honoured is a signal of its own,
SIGUSR2 (billiard delivers soft time limits on SIGUSR1, so a shared signal could not tell
the two apart). The handler raises ``Preempted``/``Cancelled`` only when the job this
process runs *now*, at this attempt, carries a stop request; an interrupt that arrives
before the request is known asks the thread to read Postgres at once and to signal again
if there is one; any other interrupt is ignored and the job runs on. Once the attempt is
stopping (a checkpoint or an interrupt raised into it), later interrupts are dropped: its
cleanup (the body's ``finally``, the runner's requeue) runs to its end.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from conveyor.client.stops import CANCEL, PREEMPT, Stops
from conveyor.delivery.connections import Connections
from conveyor.errors import Cancelled, DatabaseBusy, Preempted, is_connection_loss
from conveyor.store.db.engine import brief_write
from conveyor.store.jobs import JobStore
from conveyor.worker.admission import Admission
from conveyor.worker.context import JobContext
from conveyor.worker.flow import Flow
from conveyor.worker.leases import Leases

log = logging.getLogger("conveyor.heartbeat")

INTERRUPT_SIGNAL = signal.SIGUSR2
# How long a heartbeat waits for SQLite's writer before skipping the beat (the thread also
# delivers stop requests and interrupts: it must never queue behind a long transaction).
BEAT_WAIT = 0.25


class Heartbeat:
    """The per-process companion thread of the running job (see the module docs)."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        leases: Leases,
        stops: Stops,
        admission: Admission,
        flow: Flow,
    ) -> None:
        self.connections = connections
        self.store = store
        self.leases = leases
        self.stops = stops
        self.admission = admission
        self.flow = flow
        # One job per thread: a prefork child or solo worker runs one (in its main
        # thread), a thread pool one per pool thread.
        self._contexts: dict[int, JobContext] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._signal_pid = 0
        self._wake = threading.Event()
        self._interrupt_pending = False
        self.pending_release: dict[str, tuple[int, str]] = {}

    @property
    def current(self) -> JobContext | None:
        """The job context this process's main thread is running now (the one a signal
        can interrupt)."""
        return self._contexts.get(threading.main_thread().ident or 0)

    def track(self, ctx: JobContext | None) -> None:
        """Start (or stop, with None) renewing the lease of the calling thread's job."""
        me = threading.get_ident()
        if threading.current_thread() is threading.main_thread():
            self._interrupt_pending = False
        if ctx is None:
            self._contexts.pop(me, None)
            return
        self._contexts[me] = ctx
        self._ensure_thread()

    def requeue_uncounted(self, job_id: str, attempt: int, owner: str, reason: str) -> str:
        """Requeue an attempt stopped by an outage or a shutdown without counting it (see
        :meth:`conveyor.worker.flow.Flow.requeue_uncounted`); with the database unreachable, this
        thread does it once the database answers again (``"deferred"``)."""
        try:
            return self.flow.requeue_uncounted(job_id, attempt, owner, reason)
        except Exception as exc:
            if not is_connection_loss(exc):
                raise
            self.release_later(job_id, attempt, owner)
            return "deferred"

    def release_later(self, job_id: str, attempt: int, owner: str) -> None:
        """Requeue ``job_id`` without counting the attempt as soon as the database answers."""
        self.pending_release[job_id] = (attempt, owner)
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, name="conveyor-heartbeat", daemon=True)
            self._thread.start()

    # -- the interrupt signal -------------------------------------------------------------

    def install_interrupt_handler(self) -> None:
        """Install the SIGUSR2 handler in this process (pool child or solo worker)."""
        if self._signal_pid == os.getpid() or threading.current_thread() is not threading.main_thread():
            return
        self._signal_pid = os.getpid()
        signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between bytecodes: memory only, no I/O.
        ctx = self.current
        if ctx is None or ctx.stopping is not None:
            # Already stopping (at a checkpoint, or by an earlier interrupt): a second
            # exception would land in the body's cleanup or the runner's requeue write.
            return
        if ctx.stop_requested == PREEMPT:
            ctx.stopping = PREEMPT
            raise Preempted(f"job {ctx.job_id} interrupted: it did not yield its lease in time")
        if ctx.stop_requested == CANCEL:
            ctx.stopping = CANCEL
            raise Cancelled(f"job {ctx.job_id} interrupted after cancel()")
        self._interrupt_pending = True
        self._wake.set()

    # -- the thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        settings = self.connections.settings
        poll = min(settings.stop_poll_interval, settings.heartbeat_interval)
        db_poll = max(poll, min(settings.heartbeat_interval, settings.preempt_grace / 2))
        next_beat = time.monotonic() + settings.heartbeat_interval
        next_db_poll = time.monotonic() + db_poll
        while True:
            woken = self._wake.wait(poll)
            self._wake.clear()
            running = list(self._contexts.values())
            read_db = woken or time.monotonic() >= next_db_poll
            if read_db:
                next_db_poll = time.monotonic() + db_poll
            for ctx in running:
                self._poll_stop(ctx, read_db=read_db)
            self._deliver_pending_interrupt(self.current)
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + settings.heartbeat_interval
            if self.pending_release:
                self._flush_releases()
            for ctx in running:
                if ctx not in self._contexts.values():
                    continue  # finished meanwhile
                try:
                    self._beat(ctx)
                except Exception:  # the database may blip; the next beat tries again
                    log.warning("heartbeat failed for job %s", ctx.job_id, exc_info=True)

    def _poll_stop(self, ctx: JobContext, *, read_db: bool) -> None:
        """Read the job's stop request: the Redis fast flag, and Postgres when due."""
        if ctx.stop_requested is not None:
            return
        stops = self.stops
        try:
            ctx.stop_requested = stops.stop_requested(ctx.job_id, ctx.attempt)
            if ctx.stop_requested is None and read_db:
                ctx.stop_requested = stops.stop_requested_db(ctx.job_id, ctx.attempt)
        except Exception:  # an outage; the next poll tries again
            log.debug("stop-request poll failed", exc_info=True)

    def _deliver_pending_interrupt(self, ctx: JobContext | None) -> None:
        """An interrupt came before its stop request was known here: now that the request
        is known, signal again so the handler raises; with no request, forget it."""
        if not self._interrupt_pending or ctx is None:
            return
        self._interrupt_pending = False
        if ctx.stopping is not None:
            return  # it stopped meanwhile (at a checkpoint)
        if ctx.stop_requested is not None:
            os.kill(os.getpid(), INTERRUPT_SIGNAL)
        else:
            log.info("ignored an interrupt for job %s attempt %s: no stop request", ctx.job_id, ctx.attempt)

    def _flush_releases(self) -> None:
        for job_id, (attempt, owner) in list(self.pending_release.items()):
            try:
                self.flow.requeue_uncounted(job_id, attempt, owner, "infrastructure")
            except Exception:  # still down; try again next beat
                log.info("database still unreachable; %d release(s) pending", len(self.pending_release))
                return
            self.pending_release.pop(job_id, None)

    def _beat(self, ctx: JobContext) -> None:
        try:
            self._renew(ctx)
        except DatabaseBusy:
            # SQLite, and a long transaction (a stage body's) holds the single writer: skip
            # this beat rather than queue behind it. Nobody can take the job over while the
            # writer is held, and once it is free the relay's pass clock holds takeovers
            # until heartbeats had a lease timeout to resume (conveyor.store.liveness).
            log.debug("heartbeat of %s skipped: the SQLite writer is busy", ctx.job_id)
        if ctx.slot is not None:
            self.admission.renew(ctx.slot)

    def _renew(self, ctx: JobContext) -> None:
        with brief_write(self.connections.engine, BEAT_WAIT) as conn:
            if not self.store.heartbeat(conn, ctx.job_id, ctx.attempt):
                ctx.lease_lost = True
            if ctx.held is not None and not self.leases.renew(conn, ctx.held, ctx.job_id):
                ctx.lease_lost = True


__all__ = ["INTERRUPT_SIGNAL", "Heartbeat"]
