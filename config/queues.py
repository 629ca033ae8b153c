"""Queues and routes, declared once. Stages name their queue; nothing redeclares these."""

from __future__ import annotations

from kombu import Exchange, Queue

EXCHANGE = Exchange("conveyor", type="direct")

QUEUES = [
    # Stages that preempt others (writes) get their own queue, consumed first.
    Queue("priority", EXCHANGE, routing_key="priority"),
    Queue("default", EXCHANGE, routing_key="default"),
    Queue("demo", EXCHANGE, routing_key="demo"),
    # The files family: one queue per stage, so that each can be rate limited on its own.
    Queue("file-extract", EXCHANGE, routing_key="file-extract"),
    Queue("file-chunk", EXCHANGE, routing_key="file-chunk"),
    Queue("file-embed", EXCHANGE, routing_key="file-embed"),
    Queue("batch-completion", EXCHANGE, routing_key="batch-completion"),
]

DEFAULT_QUEUE = "default"

# The seed's per-stage limits (extract 100, chunk 50, embed 50 per minute, across all
# workers). A documented example, off by default: turn it on with
# CONVEYOR_RATE_LIMITS='{"file-extract": {"rate": 1.6667}, "file-chunk": {"rate": 0.8333},
# "file-embed": {"rate": 0.8333}}'.
SEED_FILE_RATE_LIMITS: dict[str, dict[str, float]] = {
    "file-extract": {"rate": 100 / 60},
    "file-chunk": {"rate": 50 / 60},
    "file-embed": {"rate": 50 / 60},
}
