"""Conveyor's Celery consumer: garbage messages go to the DLQ without their body, and a
broker connection lost with deliveries unacknowledged never ends the worker.

Celery 5.7's ``Consumer.on_connection_error_after_connected`` calls
``connection.collect()`` and then ``ignore_errors(connection, connection.close)``. With
the Redis transport, ``collect()`` can leave the default channel (the one holding the
unacknowledged deliveries) open: its close stops at the pending BRPOP read, and the
transport's ``close_connection`` gives up at the first channel whose close fails (the
pidbox channel deleting its auto-delete fanout queue from a Redis that is gone). Then
``collect()`` drops ``transport.client``. The ``close()`` that follows closes that channel
again, and its restore of the unacknowledged deliveries builds a connection pool from
``transport.client.hostname``: ``AttributeError`` on ``None``, which ``ignore_errors``
does not ignore, so the worker logs "Unrecoverable error" and exits. A job that finishes
after the reconnect acks through the same broken channel and fails the same way.

Here ``collect()`` gives the old transport its client back, so the restore and later
acks through the old channel reach Redis or fail with a connection error that Celery
handles; ``close()`` and acks that still fail otherwise are logged, not raised. Celery's
reconnect cycle is unchanged. See deploy/upstream/celery-redis-restart.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from vine import promise

from conveyor.delivery.celeryconfig import CELERY_DEFAULT_QUEUE
from conveyor.worker.slots import Slots

log = logging.getLogger("conveyor.consumer")

TEARDOWN_FAILED = (
    "closing the lost broker connection failed (%r); reconnecting anyway. Its unacknowledged "
    "deliveries come back with the visibility timeout or are republished from Postgres"
)
ACK_FAILED = (
    "could not acknowledge a delivery (%r); it comes back with the visibility timeout and "
    "a job that already ran is not run again"
)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer, except that unrunnable messages go to the DLQ without their body,
    and that tearing down a lost broker connection cannot raise.

    Celery's own handlers log the full message body, which may hold personal data. On
    Celery's default queue (consumed with ``consume_default_queue``), shared with whatever
    else the caller's Celery apps send there, a message that is not a stage's is not ours
    to refuse: it goes back untouched (see :meth:`_left_to_others`).
    """

    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc]
        """Celery's consumer steps without native delayed delivery: Conveyor delays jobs in
        Postgres and never publishes a countdown, and on RabbitMQ that step would bind
        every queue to 28 delay exchanges (and warn that a direct exchange cannot use them)."""

        default_steps = [
            step for step in CeleryConsumer.Blueprint.default_steps if not step.endswith(":DelayedDelivery")
        ]

    _away_from_default = False  # stepped back from the default queue, coming back on a timer
    _slots: Slots | None = None  # RabbitMQ: one unacknowledged delivery per pool slot

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before Celery's __init__: it builds the steps, which may add hooks here.
        self.while_waiting: list[Callable[[Any], object]] = []
        super().__init__(*args, **kwargs)

    def ensure_connected(self, conn: Any) -> Any:
        """Celery's wait for the broker (kombu retries for as long as it is away), with
        each of :attr:`while_waiting` called with this consumer at each miss and about
        every second of the pauses between tries (kombu's retry ``callback``): the
        liveness tick of :class:`conveyor.worker.loop_probe.LoopTicks`."""
        ensure, hooks = conn.ensure_connection, self.while_waiting

        def ensure_connection(*args: Any, callback: Callable[[], object] | None = None, **kwargs: Any) -> Any:
            def each() -> None:
                for hook in hooks:
                    try:
                        hook(self)
                    except Exception:  # a tick not written must not end the wait
                        log.debug("while_waiting hook failed", exc_info=True)
                if callback is not None:
                    callback()

            return ensure(*args, callback=each, **kwargs)

        conn.ensure_connection = ensure_connection
        return super().ensure_connected(conn)

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], Any]:
        """Celery's handler of task messages; on RabbitMQ behind :class:`Slots`."""
        handler: Callable[[Any], Any] = super().create_task_handler(promise)
        if self.connection.transport.driver_type != "amqp":
            return handler
        if self._slots is None:
            self._slots = Slots(self)
        slots = self._slots
        slots.start()

        def on_task_received(message: Any) -> Any:
            if slots.admit(message):
                return handler(message)
            return None

        return on_task_received

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        """Celery's teardown of the lost connection, with its ``collect()`` no longer
        dropping the transport's client before ``close()`` has restored the deliveries
        through it, and with ``close()`` unable to raise. The rest of Celery's handling and
        its reconnect cycle stay as they are."""
        connection = self.connection
        if connection is not None:
            connection.collect = _keeping_client(connection, connection.collect)
            connection.close = _never_raising(connection.close)
        super().on_connection_error_after_connected(exc)

    def call_soon_ack(self, p: Callable[..., object], *args: Any, **kwargs: Any) -> Any:
        """Celery's ack/reject, except that one failing with anything but a broker error
        is logged instead of ending the worker (Celery already does so without a hub).

        A job finishing after a reconnect acks through its delivery's old channel; if that
        channel's teardown went wrong, the ack raises from the event loop.
        """
        recoverable = (*self.connection_errors, *self.channel_errors)

        slots = self._slots

        def ack() -> None:
            try:
                p(*args, **kwargs)
            except recoverable:
                raise
            except Exception as exc:
                log.warning(ACK_FAILED, exc)
                log.debug("ack failure", exc_info=True)
            if slots is not None:
                slots.resume()  # the slot this delivery held is free

        return super().call_soon_ack(ack)

    def _left_to_others(self, message: Any) -> bool:
        """Requeue a message of Celery's default queue that is not a stage's, untouched
        (kombu only marks it redelivered), for another Celery worker of that queue; True
        if it was one. This worker then leaves the queue for ``default_queue_pause``, so a
        message no one here can run is taken again at most that often, and the other
        consumers get their turn at it."""
        host = self.app.conveyor
        info = getattr(message, "delivery_info", None) or {}
        if not host.settings.consume_default_queue or info.get("routing_key") != CELERY_DEFAULT_QUEUE:
            return False
        name = (getattr(message, "headers", None) or {}).get("task")
        if isinstance(name, str) and name in host.stages:
            return False  # a stage's message: refused as on any other queue
        message.reject_log_error(log, self.connection_errors, requeue=True)
        log.info("left task %r on queue %r to other workers", str(name)[:200], CELERY_DEFAULT_QUEUE)
        self._step_back(host.settings.default_queue_pause)
        return True

    def _step_back(self, pause: float) -> None:
        if self._away_from_default:
            return
        try:
            self.cancel_task_queue(CELERY_DEFAULT_QUEUE)
        except Exception as exc:
            log.warning("could not stop consuming %r (%r)", CELERY_DEFAULT_QUEUE, exc)
            return
        self._away_from_default = True
        self.timer.call_after(pause, self._come_back)

    def _come_back(self) -> None:
        self._away_from_default = False
        try:
            self.add_task_queue(CELERY_DEFAULT_QUEUE)
        except Exception as exc:  # selected again all the same: a reconnect consumes it
            log.warning("could not consume %r again yet (%r)", CELERY_DEFAULT_QUEUE, exc)

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
        if self._left_to_others(message):
            return
        self._garbage(message, "UnknownMessage", "message is not a Celery task message")
        message.reject_log_error(log, self.connection_errors)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        if self._left_to_others(message):
            return
        name = (getattr(message, "headers", None) or {}).get("task", "?")
        self._garbage(message, "UnknownTask", f"no stage named {str(name)[:200]!r} is registered")
        message.reject_log_error(log, self.connection_errors)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        if self._left_to_others(message):
            return
        self._garbage(message, type(exc).__name__, f"invalid task message: {str(exc)[:300]}")
        message.reject_log_error(log, self.connection_errors)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        if self._left_to_others(message):
            return
        self._garbage(message, "DecodeError", f"message body could not be decoded: {str(exc)[:300]}")
        message.ack()


def _keeping_client(connection: Any, collect: Callable[..., object]) -> Callable[..., None]:
    """``collect`` that leaves the transport its ``client``: closing a channel that
    ``collect`` left open, and acking through it later, build a pool from it."""
    transport = connection.transport

    def collect_keeping_client(*args: Any, **kwargs: Any) -> None:
        try:
            collect(*args, **kwargs)
        finally:
            transport.client = connection

    return collect_keeping_client


def _never_raising(close: Callable[[], object]) -> Callable[[], None]:
    """``close`` of a connection that is being discarded: any failure is logged, not raised."""

    def safe_close() -> None:
        try:
            close()
        except Exception as exc:
            log.warning(TEARDOWN_FAILED, exc)
            log.debug("close failure", exc_info=True)

    return safe_close
