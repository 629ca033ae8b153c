"""Queues and routes, declared once. Stages name their queue; nothing redeclares these."""

from __future__ import annotations

from kombu import Exchange, Queue

EXCHANGE = Exchange("conveyor", type="direct")

QUEUES = [
    # Stages that preempt others (writes) get their own queue, consumed first.
    Queue("priority", EXCHANGE, routing_key="priority"),
    Queue("default", EXCHANGE, routing_key="default"),
    Queue("demo", EXCHANGE, routing_key="demo"),
    Queue("files", EXCHANGE, routing_key="files"),
]

DEFAULT_QUEUE = "default"
