"""At most one unacknowledged delivery per pool slot, on RabbitMQ.

Preemption relies on it: a worker whose slots are all busy must not sit on a message it
cannot start (a write waiting behind a long sync), where another worker, or this one a
moment later, would run it. On Redis, Celery's ``worker_disable_prefetch`` stops fetching
while every slot is taken. On RabbitMQ Celery ignores that setting, and quorum queues only
have a per-consumer prefetch, one consumer per queue, so a worker consuming seven queues
could hold seven messages per slot.

Here a delivery that arrives while every slot is taken is handed straight back
(``basic.reject`` with requeue) and that queue's consumer is cancelled; when a slot frees
(an ack), the cancelled queues are consumed again. Each queue's consumer keeps Celery's
prefetch (the pool's size, so one queue can fill every slot), so a worker holds no
message it cannot start for longer than the round trip that hands it back.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state

log = logging.getLogger("conveyor.slots")

RESUME_CHECK = 1.0  # seconds: a safety net; an ack resumes at once


class Slots:
    """The gate of one Celery consumer (see the module's docstring)."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.paused: set[str] = set()
        self._cset: Any = None
        self._timer_set = False

    def start(self) -> None:
        """Called as the consumer's loop (re)starts: nothing paused on the fresh task consumer."""
        c = self.consumer
        self.paused.clear()
        self._cset = c.task_consumer
        if not self._timer_set:
            self._timer_set = True
            c.timer.call_repeatedly(RESUME_CHECK, self.resume)

    def limit(self) -> int:
        """The pool's slots."""
        c = self.consumer
        return int(getattr(c.controller, "max_concurrency", None) or c.pool.num_processes or 1)

    def admit(self, message: Any) -> bool:
        """Whether ``message`` may be taken now; if not, it went back to its queue and that
        queue's consumer is paused."""
        if len(state.reserved_requests) < self.limit():
            return True
        c = self.consumer
        message.reject_log_error(log, c.connection_errors, requeue=True)
        tag = (getattr(message, "delivery_info", None) or {}).get("consumer_tag")
        cset = c.task_consumer
        for name, active in list(cset._active_tags.items()):
            if active == tag:
                # kombu's cancel_by_queue would also forget the queue; consume() brings
                # back every queue it still knows that has no consumer.
                cset._active_tags.pop(name, None)
                getattr(cset, "_active_queue_no_ack", {}).pop(name, None)
                cset.channel.basic_cancel(tag)
                self.paused.add(name)
                log.debug("every slot busy: paused queue %s", name)
        return False

    def resume(self) -> None:
        """Consume the paused queues again if a slot is free."""
        c = self.consumer
        cset = c.task_consumer
        if not self.paused or cset is None or cset is not self._cset:
            return
        if len(state.reserved_requests) >= self.limit():
            return
        self.paused.clear()
        try:
            cset.consume()
        except c.connection_errors + c.channel_errors as exc:  # the reconnect consumes all
            log.info("could not resume consuming (%r)", exc)


__all__ = ["Slots"]
