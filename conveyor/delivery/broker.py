"""Delivery through Celery/kombu, plus the broker epoch that detects a wiped Redis."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.entity import Exchange, Queue
from kombu.exceptions import ChannelError
from redis import Redis

from conveyor import tracing
from conveyor.delivery import amqp as rabbit
from conveyor.delivery.fastpath import FastPath
from conveyor.delivery.reprs import as_list, quick_kwargsrepr, repr_limits
from conveyor.delivery.wakeups import Wakeups
from conveyor.store.db.schema import IGNORE_RESULT

log = logging.getLogger("conveyor.broker")

JOB_HEADER = "conveyor_job_id"
KwargsRepr = Callable[[Mapping[str, Any]], str]
MASKED = "(masked)"  # the kwargsrepr of a stage that masks its payload, where its code is absent


@dataclass(frozen=True)
class Outgoing:
    """One message of :meth:`Broker.publish_many`: a committed job's id, stage, queue,
    payload and Celery task id."""

    job_id: str
    stage: str
    queue: str
    payload: Mapping[str, Any]
    task_id: str
    ignore_result: bool = True


class Broker:
    """Publishes job messages and owns the epoch key.

    The epoch is a random value in Redis, created only right after every queue and binding
    was declared. A job published under another epoch may have been lost with the old
    Redis, so the relay republishes it. kombu drops a publish silently while the exchange
    bindings are missing, so a publisher that finds no epoch declares first. With RabbitMQ
    as the broker (``amqp``), the epoch is the broker's own (:class:`conveyor.delivery.amqp.AmqpEpoch`)
    and Redis only caches it; publishes are confirmed and mandatory.
    """

    def __init__(
        self,
        app: Celery,
        redis: Redis,
        queues: Sequence[Queue],
        key_prefix: str,
        *,
        fast: FastPath | None = None,
        direct: bool = False,
        amqp_epoch: rabbit.AmqpEpoch | None = None,
    ) -> None:
        self.app = app
        self.redis = redis
        self.queues = list(queues)
        self.epoch_key = f"{key_prefix}epoch"
        self.key_prefix = key_prefix
        self.fast = fast
        # A client that knows no queue declarations publishes straight into each queue's
        # list (the default exchange), never creates the epoch, and leaves a job it cannot
        # place to the relay, which knows every queue.
        self.direct = direct
        self.amqp_epoch = amqp_epoch
        self._epoch: str | None = None
        self._mismatch_told = False
        self._inspect_conn: Any = None
        self._inspect_pid = 0
        self._lock_inspect = threading.Lock()
        self._epoch_read = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()
        self.wakeups = Wakeups(redis)
        # A stage's own kwargsrepr (what Flower shows of a payload holding personal data),
        # by stage name: set by whoever knows the stages (the platform, the by-name client).
        self.kwargsrepr_for: Callable[[str], KwargsRepr | None] = lambda stage: None

    def kwargsrepr(self, stage: str, payload: Mapping[str, Any], maxsize: int, maxlevels: int) -> str | None:
        """The message's ``kwargsrepr`` header: the stage's own when it has one (a failing
        one writes ``(masked)``, never the payload), else :func:`quick_kwargsrepr`'s."""
        custom = self.kwargsrepr_for(stage)
        if custom is None:
            return quick_kwargsrepr(payload, maxsize, maxlevels)
        try:
            return str(custom(payload))[:maxsize]
        except Exception:
            log.warning("the kwargsrepr of stage %s failed; published as (masked)", stage, exc_info=True)
            return MASKED

    def submit_epoch(self, *, max_age: float = 1.0) -> str | None:
        """The epoch a job about to be inserted is published under, asking Redis only
        briefly (:class:`FastPath`); None if Redis does not answer: the job is inserted
        unpublished and the relay publishes it once Redis is back."""
        cached = self._cached(max_age)
        if cached is not None:
            return cached
        if self.fast is None:
            return self.epoch(max_age=max_age)
        epoch = self.fast.attempt(lambda client: self._read_epoch(client, fast=True))
        if epoch is not None:
            self._epoch, self._epoch_read = epoch, time.monotonic()
        return epoch

    def epoch(self, *, max_age: float = 1.0) -> str:
        """The current epoch, declaring queues and creating one if Redis has none.

        A cached value up to ``max_age`` old is fine: a publish made under an epoch that
        just vanished records the old epoch and is republished by the relay.
        """
        now = time.monotonic()
        cached = self._cached(max_age)
        if cached is not None:
            return cached
        with self._lock:
            epoch: str | None
            if self.amqp_epoch is not None and not self.direct:
                epoch = self._verified_amqp_epoch()
            else:
                epoch = self._read_epoch(self.redis, fast=False)
            if epoch is None:  # a direct publisher: a failed publish, left to the relay
                raise ConnectionError("no broker epoch yet: the workers' relay creates it")
            self._epoch, self._epoch_read = epoch, now
            return epoch

    def _cached(self, max_age: float) -> str | None:
        """The epoch read less than ``max_age`` seconds ago, if any."""
        if self._epoch is not None and time.monotonic() - self._epoch_read < max_age:
            return self._epoch
        return None

    def _read_epoch(self, client: Redis, *, fast: bool) -> str | None:
        """The epoch in Redis, created (after declaring every queue) if missing; None when
        missing and this publisher is direct (it knows no queues: the relay creates it),
        and None when it is the epoch of another kind of broker than this process's."""
        value = client.get(self.epoch_key)
        if value is not None and not self._same_broker(
            value.decode() if isinstance(value, bytes) else str(value)
        ):
            if self.direct or fast:
                return None  # published by the relay, through the workers' broker
            value = None  # a deployment back on Redis: a new epoch
            client.delete(self.epoch_key)
        if value is None and (self.direct or (fast and self.amqp_epoch is not None)):
            return None  # RabbitMQ's epoch is read and checked by the relay, not a submit
        if value is None and self.amqp_epoch is not None:
            return self._verified_amqp_epoch()
        if value is None:
            self.declare_all(fast=fast)
            client.set(self.epoch_key, secrets.token_hex(8), nx=True)
            value = client.get(self.epoch_key)
        return value.decode() if isinstance(value, bytes) else str(value)

    def _same_broker(self, epoch: str) -> bool:
        """Whether ``epoch`` is of this process's kind of broker; if not, says so once:
        whatever this process would publish, the workers would never see."""
        same = epoch.startswith(rabbit.EPOCH_PREFIX) == (self.amqp_epoch is not None)
        if not same and not self._mismatch_told:
            self._mismatch_told = True
            mine, theirs = ("RabbitMQ", "Redis") if self.amqp_epoch is not None else ("Redis", "RabbitMQ")
            log.error(
                "this process's broker is %s but the workers' is %s: set CONVEYOR_BROKER_URL "
                "to the workers' broker (until then its jobs are published by the workers' relay)",
                mine,
                theirs,
            )
        return same

    def _verified_amqp_epoch(self) -> str:
        """RabbitMQ's epoch, its marker queue checked (the relay asks every pass), cached."""
        assert self.amqp_epoch is not None
        raw = self.redis.get(self.epoch_key)
        cached = raw.decode() if isinstance(raw, bytes) else None
        with self._inspecting() as conn:
            epoch = self.amqp_epoch.current(conn, cached, self._declare_on)
        if epoch != cached:
            self.redis.set(self.epoch_key, epoch)
        return epoch

    @contextlib.contextmanager
    def _inspecting(self) -> Iterator[Any]:
        """This process's RabbitMQ connection for the relay's epoch check and queue counts
        (every pass: not a new connection each time), dropped after any failure, so the
        next use connects afresh (a node restarted under it)."""
        with self._lock_inspect:
            conn = self._inspect_conn
            if conn is None or self._inspect_pid != os.getpid():
                conn = self._inspect_conn = self.app.connection_for_write(heartbeat=0)
                self._inspect_pid = os.getpid()
            try:
                conn.ensure_connection(max_retries=1)
                yield conn
            except BaseException:
                self._inspect_conn = None
                with contextlib.suppress(Exception):
                    conn.release()
                raise

    def _declare_on(self, connection: Any) -> None:
        channel = connection.default_channel
        for queue in self.queues:
            queue.bind(channel).declare()  # type: ignore[no-untyped-call]

    def declare_all(self, *, fast: bool = False) -> None:
        """Declare every queue, exchange and binding, bypassing kombu's declared-cache
        (with ``fast``, over this thread's short-timeout submit connection)."""
        if fast:
            self._declare_on(self._fast_connection())
            return
        with self.app.connection_for_write() as conn:
            self._declare_on(conn)

    def _fast_connection(self) -> Any:
        """This thread's broker connection for submits: short socket timeouts, no retry."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid() or getattr(local, "conn", None) is None:
            timeout = self.fast.timeout if self.fast is not None else None
            options: dict[str, Any] = {
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "retry_on_timeout": False,
            }
            extra: dict[str, Any] = {}
            if self.amqp_epoch is not None:
                # A quorum queue confirms after its Raft log is written: give it a second,
                # for the connect too, and no retry (kombu's would wait Celery's 4 s each).
                wait = max(1.0, timeout or 0.0)
                options = {"read_timeout": wait, "write_timeout": wait, "max_retries": 0}
                options["confirm_publish"] = True
                # Idle between submits: nothing would answer the broker's heartbeats.
                extra = {"heartbeat": 0, "connect_timeout": wait}
            local.conn = self.app.connection_for_write(transport_options=options, **extra)
            local.pid = os.getpid()
            local.producer = None
        return local.conn

    def _fast_producer(self) -> Any:
        """A producer on :meth:`_fast_connection`, kept with it (one per submit costs as
        much as the publish's own Python)."""
        conn = self._fast_connection()
        producer = getattr(self._local, "producer", None)
        if producer is None:
            producer = self._local.producer = conn.Producer()
        return producer

    def drop_fast_connection(self) -> None:
        """Close this thread's submit connection (after it failed: the next one reconnects)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        self._local.producer = None
        if conn is not None:
            with contextlib.suppress(Exception):  # a dead connection may fail to close
                conn.release()

    def message_counts(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages waiting in each queue (not counting ones delivered and unacked)."""
        out: dict[str, int] = {}
        if self.amqp_epoch is not None:
            with self._inspecting() as conn:
                return rabbit.message_counts(conn, queues)
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in queues:
                try:
                    out[name] = int(channel.queue_declare(queue=name, passive=True).message_count)
                except ChannelError:  # Redis: a queue with no message has no key at all
                    out[name] = 0
        return out

    def publish(
        self,
        *,
        stage: str,
        job_id: str,
        queue: str,
        payload: Mapping[str, Any],
        options: Mapping[str, Any],
        task_id: str | None = None,
        fast: bool = False,
        trace_context: Mapping[str, Any] | None = None,
    ) -> str:
        """Send one job message; returns the Celery task id used (fresh unless given).

        With ``fast`` (submits), over this thread's short-timeout connection, without
        kombu's publish retries: a submit never waits on Redis; the relay publishes later.

        ``trace_context`` (the job row's) goes into the message headers and is current
        while the message is sent, so a publish span of Celery's instrumentation (it hooks
        ``before_task_publish``, which ``send_task_message`` fires) is in the job's trace.

        The same message ``send_task`` builds, without its result-backend subscription:
        job outcomes are awaited through :meth:`JobHandle.wait`, and ``AsyncResult.get()``
        still works because it subscribes (and reads the stored result) when called.
        """
        task_id = task_id or str(uuid.uuid4())
        app = self.app
        celery_amqp = app.amqp
        headers = {JOB_HEADER: job_id, **tracing.headers(trace_context)}
        if self.direct:
            routed = {
                "queue": Queue(queue, Exchange(""), routing_key=queue),  # type: ignore[no-untyped-call]
                "declare": [],
                "headers": headers,
            }
        else:
            routed = celery_amqp.router.route({"queue": queue, "headers": headers}, stage, (), dict(payload))
        message = celery_amqp.create_task_message(
            task_id,
            stage,
            (),
            dict(payload),
            None,
            # When a delayed job was due (it is published once due: no wait in the worker).
            dt.datetime.fromisoformat(options["eta"]) if options.get("eta") else None,
            options.get("group_id"),
            options.get("group_index"),
            None,
            0,
            options.get("chord"),
            as_list(options.get("link")),
            as_list(options.get("link_error")),
            app.thread_oid,
            options.get("time_limit"),  # a call's own limits (.set(soft_time_limit=...)), if any
            options.get("soft_time_limit"),
            app.conf.task_send_sent_event,
            options.get("root_id") or job_id,  # the job's task id, whatever this message's
            options.get("parent_id"),
            None,
            options.get("chain"),
            # A job of submit() is awaited through its row: no result to store (see
            # conveyor.delivery.celeryconfig); a chord member is still counted.
            ignore_result=bool(options.get(IGNORE_RESULT)),
            argsrepr="()",  # saferepr(()): every stage takes its payload as kwargs
            kwargsrepr=self.kwargsrepr(stage, payload, *repr_limits(app)),
            stamped_headers=options.get("stamped_headers"),
            **{k: options[k] for k in options.get("stamped_headers") or () if k in options},
            **routed,
        )
        if options.get("priority") is not None:
            routed["priority"] = options["priority"]
        confirmed = self.amqp_epoch is not None
        if confirmed:
            routed["mandatory"] = True
        with tracing.attached(trace_context):
            if fast:
                target = routed.get("queue")
                if isinstance(target, Queue) and getattr(target.exchange, "type", None) == "direct":
                    # Celery sends to a direct exchange's queue list by name (the anonymous
                    # exchange): declaring it on every submit only rebinds what is bound.
                    routed["declare"] = []
                # RabbitMQ closes a kept connection now and then (a restart, an idle
                # timeout of a proxy): one more try on a fresh one before the relay's turn.
                kept = getattr(self._local, "conn", None) is not None
                for tries_left in (1, 0) if confirmed and kept else (0,):
                    try:
                        producer = self._fast_producer()
                        with rabbit.taken_by_queues(producer, [task_id] if confirmed else []):
                            celery_amqp.send_task_message(producer, stage, message, retry=False, **routed)
                        break
                    except rabbit.Unroutable:
                        raise  # the broker answered: the connection is fine
                    except Exception:
                        self.drop_fast_connection()
                        if not tries_left:
                            raise
                return task_id
            with app.producer_or_acquire(None) as producer:
                try:
                    with rabbit.taken_by_queues(producer, [task_id] if confirmed else []):
                        celery_amqp.send_task_message(producer, stage, message, **routed)
                except rabbit.Unroutable:
                    # The relay's publish: a queue is gone (deleted by hand, a node
                    # replaced). Declare them all and send once more.
                    self.declare_all()
                    with rabbit.taken_by_queues(producer, [task_id]):
                        celery_amqp.send_task_message(producer, stage, message, **routed)
        return task_id

    def publish_many(
        self,
        jobs: Sequence[Outgoing],
        *,
        trace_context: Mapping[str, Any] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Send the messages of many fresh jobs through one pipelined Redis call.

        Each message is the one :meth:`publish` sends for a ``submit()`` job (no canvas
        options: the same headers, properties and body from ``create_task_message``),
        routed straight to its queue's list (the default exchange, as a direct publisher
        does: no binding lookup per message) over this thread's short-timeout connection,
        through kombu's publish batch, so kombu writes the wire format the worker consumes.
        The ``kwargsrepr`` header is written by :func:`quick_kwargsrepr` where it can (the
        same text). Unlike :meth:`publish` it hands each message to ``Producer.publish``, so
        Celery's per-message ``before/after_task_publish`` signals are not sent (the
        caller's one ``conveyor.submit_many`` span stands for them), unless task-sent
        events are on (``CONVEYOR_TASK_EVENTS``): then Celery sends each message as
        :meth:`publish` does, with its event. Raises on any failure (some messages may have
        gone out): the caller leaves the jobs to the relay.

        ``ready`` is called once every message is built and before any is sent: it may wait
        (for the jobs' commit), and if it raises nothing is sent.
        """
        if not jobs:
            return
        app = self.app
        amqp = app.amqp
        create = amqp.create_task_message
        sent_event = bool(app.conf.task_send_sent_event)
        oid = app.thread_oid
        traced = tracing.headers(trace_context)
        serializer = app.conf.task_serializer
        maxsize, maxlevels = repr_limits(app)
        delivery_mode = app.conf.task_default_delivery_mode
        confirmed = self.amqp_epoch is not None  # RabbitMQ: a returned message failed

        def build(job: Outgoing) -> tuple[Outgoing, Any]:
            message = create(
                job.task_id, job.stage, (), job.payload,
                None, None, None, None, None, 0, None, None, None,
                oid, None, None, sent_event, None, None, None, None,
                ignore_result=job.ignore_result,
                argsrepr="()",  # saferepr(()): every stage takes its payload as kwargs
                kwargsrepr=self.kwargsrepr(job.stage, job.payload, maxsize, maxlevels),
            )  # fmt: skip
            message.headers[JOB_HEADER] = job.job_id
            if traced:
                message.headers.update(traced)
            return job, message

        def send(producer: Any, job: Outgoing, message: Any) -> None:
            if sent_event:  # Celery sends it, with its task-sent event
                queue = Queue(job.queue, Exchange(""), routing_key=job.queue)  # type: ignore[no-untyped-call]
                amqp.send_task_message(
                    producer, job.stage, message, retry=False, queue=queue, declare=[], mandatory=confirmed
                )
                return
            producer.publish(
                message.body,
                mandatory=confirmed,
                exchange="",
                routing_key=job.queue,
                serializer=serializer,
                delivery_mode=delivery_mode,
                declare=[],
                retry=False,
                headers=message.headers,
                **message.properties,
            )

        with tracing.attached(trace_context):
            try:
                producer = self._fast_producer()
                if sent_event or confirmed or not hasattr(producer, "batch"):
                    # Task-sent events on, RabbitMQ (each publish confirmed), or kombu < 5.7
                    # (no publish batch): every message is built first and sent once
                    # ``ready`` returned, one call each.
                    built = [build(job) for job in jobs]
                    if ready is not None:
                        ready()
                    with rabbit.taken_by_queues(producer, [job.task_id for job in jobs] if confirmed else []):
                        for job, message in built:
                            send(producer, job, message)
                    return
                with producer.batch(max_size=len(jobs) + 1):
                    for job in jobs:
                        send(producer, *build(job))
                    if ready is not None:
                        ready()
            except Exception:
                self.drop_fast_connection()
                raise

    def notify(self, job_id: str, status: str) -> None:
        """Wake anyone waiting on ``job_id`` (see :meth:`JobHandle.wait`); a hint sent
        without awaiting a reply (:mod:`conveyor.delivery.wakeups`)."""
        self.wakeups.publish(self.wake_channel(job_id), status)

    def wake_channel(self, job_id: str) -> str:
        """The pub/sub channel announcing ``job_id``'s terminal state."""
        return f"{self.key_prefix}done:{job_id}"
