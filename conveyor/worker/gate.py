"""The gate before a claim: blackout windows, the queue's rate limit and the stage's
concurrency cap (per key), each parking a job that may not start yet.

A parked job is ``throttled`` in Postgres (visible, never dropped, no pool slot) with
``run_at`` when it may try again, and the relay publishes it then:

- inside a blackout window (``blackout=`` on the stage), until the window's end, with a
  ``job.blackout`` event naming the window;
- over the rate limit, until its reserved token time (:mod:`conveyor.worker.admission`);
- over its concurrency key's limit, until a slot of that key frees: the release wakes the
  longest-parked job of the key (a list in Redis beside the slots). Should that wake be
  lost (a Redis wipe, a killed worker whose slot expires instead), ``run_at`` brings the
  job back after the slot lifetime anyway.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Container, Mapping
from typing import Any

from celery.exceptions import Ignore

from conveyor.calendar import blocking
from conveyor.client.recorder import Recorder
from conveyor.delivery.connections import Connections
from conveyor.errors import PayloadInvalid
from conveyor.metrics import Metrics
from conveyor.stage import StageSpec
from conveyor.store.db import schema as s
from conveyor.store.jobs import JobStore
from conveyor.wire import from_wire
from conveyor.worker.admission import Admission, Slot

log = logging.getLogger("conveyor.gate")

# Wakes tried per release: a listed job may have ended, been cancelled or woken already.
WAKE_TRIES = 5


class Gate:
    """Admits a delivery or parks its job; gives slots back and wakes their waiters."""

    def __init__(
        self,
        connections: Connections,
        *,
        store: JobStore,
        recorder: Recorder,
        admission: Admission,
        metrics: Metrics,
    ) -> None:
        self.connections = connections
        self.store = store
        self.recorder = recorder
        self.admission = admission
        self.metrics = metrics
        self.queue_names = frozenset(q.name for q in connections.queues)

    def admit(self, spec: StageSpec, req: Any, job_id: str) -> Slot | None:
        """The slot this delivery holds (None: uncapped), or :class:`Ignore` once its job
        is parked (the delivery is acked; the relay or a wake publishes the job again)."""
        queue = queue_of(req, spec, self.queue_names)
        rate = self.connections.settings.rate_limits.get(queue)
        keyed = spec.concurrency_key is not None
        if rate is None and not spec.capped and spec.blackout is None:
            return None
        payload: Mapping[str, Any] = {}
        if keyed or spec.blackout is not None:
            stored = self._waiting_payload(job_id)
            if stored is None:
                return None  # not waiting to be claimed: the claim says why
            payload = stored
        if spec.blackout is not None:
            self._hold_in_blackout(spec, queue, job_id, payload)
        capped = spec.concurrency_of(payload) if spec.capped else None
        key, limit = capped if capped is not None else ("", None)
        verdict = self.admission.check(
            queue=queue, rate=rate, stage=spec.name, concurrency=limit, job_id=job_id, key=key
        )
        if verdict.reason is None:
            return verdict.slot
        body: dict[str, Any] = {"stage": spec.name, "queue": queue, "reason": verdict.reason}
        if verdict.reason == "concurrency":
            assert limit is not None
            body.update(limit=limit, **({"key": key} if key else {}))
            # The wake brings it back; run_at only if that wake is lost.
            wait = max(verdict.wait, self.admission.slot_ttl_ms / 1000)
            if not self._park(spec, job_id, wait=wait, body=body):
                return None  # not waiting to be claimed: the claim says why
            slot_key = self.admission.slot_key(spec.name, key)
            try:
                if self.admission.add_waiter(slot_key, job_id, limit):
                    self.wake(slot_key)
            except Exception:  # run_at brings it back
                log.warning("could not list job %s as waiting for %s", job_id, slot_key, exc_info=True)
            raise Ignore()
        if not self._park(spec, job_id, wait=verdict.wait, body=body):
            return None
        raise Ignore()

    def _waiting_payload(self, job_id: str) -> Mapping[str, Any] | None:
        with self.connections.engine.connect() as conn:
            row = self.store.get(conn, job_id)
        if row is None or row["status"] not in s.CLAIMABLE:
            return None
        return dict(from_wire(row["payload"] or {}))

    def _hold_in_blackout(self, spec: StageSpec, queue: str, job_id: str, payload: Mapping[str, Any]) -> None:
        assert spec.blackout is not None
        try:
            model = spec.validate(payload)
        except PayloadInvalid:
            return  # the claim dead-letters it
        now = dt.datetime.now(dt.UTC)
        held = blocking(spec.blackout(model), now)
        if held is None:
            return
        window, until = held
        body = {"stage": spec.name, "queue": queue, "reason": "blackout", "window": window.name}
        body["until"] = until.isoformat()
        wait = (until - now).total_seconds()
        if self._park(spec, job_id, wait=wait, body=body, topic="job.blackout", until=until):
            raise Ignore()

    def _park(
        self,
        spec: StageSpec,
        job_id: str,
        *,
        wait: float,
        body: Mapping[str, Any],
        topic: str = "job.rate_limited",
        until: dt.datetime | None = None,
    ) -> bool:
        """Park the job (False: it is not waiting to be claimed)."""
        with self.connections.engine.begin() as conn:
            parked = self.store.throttle(conn, job_id, wait=wait, body=body, topic=topic, until=until)
        if parked:
            self.metrics.inc("throttled", spec.name)
        return parked

    def give_back(self, slot: Slot | None) -> None:
        """A delivery that will not run gives back the slot it took; one its job held
        already (another copy of the job runs with it) stays with that copy."""
        if slot is not None and slot.fresh:
            self.release(slot)

    def release(self, slot: Slot | None) -> None:
        """Give a slot back and wake the longest-parked job waiting for one of its key."""
        if slot is None:
            return
        try:
            self.admission.release(slot)
            self.wake(slot.key)
        except Exception:  # the slot expires on its own; parked jobs come back at run_at
            log.warning("could not release concurrency slot %s", slot.key, exc_info=True)

    def wake(self, slot_key: str) -> str | None:
        """Publish the longest-parked job of ``slot_key`` now; its id, or None."""
        for _ in range(WAKE_TRIES):
            job_id = self.admission.next_waiter(slot_key)
            if job_id is None:
                return None
            with self.connections.engine.begin() as conn:
                woken = self.store.unthrottle(
                    conn, job_id, topic="job.unparked", body={"reason": "slot_freed"}
                )
            if woken:
                self.recorder.republish_if_queued(job_id)
                return job_id
        return None


def queue_of(req: Any, spec: StageSpec, known: Container[str]) -> str:
    """The queue a delivery came from, if it is one of the deployment's, else the stage's
    own (Celery's default queue is no home for a job: the relay republishes to this)."""
    info = getattr(req, "delivery_info", None) or {}
    routing_key = info.get("routing_key")
    return str(routing_key) if routing_key in known else spec.queue


__all__ = ["Gate", "queue_of"]
