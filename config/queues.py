"""Queues and routes, declared once. Stages name their queue; nothing redeclares these.

Every queue is a durable quorum queue on RabbitMQ (replicated, and the queue type whose
messages survive a node's loss); on Redis the argument means nothing. Quorum queues refuse
``x-max-priority``: on RabbitMQ a job's priority orders the relay and parked jobs only.
"""

from __future__ import annotations

from kombu import Exchange

from conveyor.delivery.amqp import quorum_queue

EXCHANGE = Exchange("conveyor", type="direct")

QUEUES = [
    # Stages that preempt others (writes) get their own queue, consumed first.
    quorum_queue("priority", EXCHANGE),
    quorum_queue("default", EXCHANGE),
    quorum_queue("demo", EXCHANGE),
    # The files family: one queue per stage, so that each can be rate limited on its own.
    quorum_queue("file-extract", EXCHANGE),
    quorum_queue("file-chunk", EXCHANGE),
    quorum_queue("file-embed", EXCHANGE),
    quorum_queue("batch-completion", EXCHANGE),
    # The email family. Its seed's 100 messages/s across workers is
    # CONVEYOR_RATE_LIMITS='{"email": {"rate": 100}}' (off by default).
    quorum_queue("email", EXCHANGE),
    # The publisher family: posts and first comments. Per-channel and per-account limits
    # are the stage's (CONVEYOR_PUBLISHER.channel_concurrency, one lease per account).
    quorum_queue("publisher", EXCHANGE),
    # The trading family, one queue per seed worker; each stage's concurrency across all
    # workers is CONVEYOR_TRADING.concurrency (the seed's 2, 2, 4, 1).
    quorum_queue("q_import", EXCHANGE),
    quorum_queue("q_score", EXCHANGE),
    quorum_queue("q_sim", EXCHANGE),
    quorum_queue("q_digest", EXCHANGE),
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
