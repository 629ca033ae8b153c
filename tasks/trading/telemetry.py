"""The trading family's metrics, in base units, through the platform's lazy factory
(:mod:`conveyor.metrics`): nothing is made (and ``prometheus_client`` not imported) until a
worker enables metrics (``conveyor worker --metrics-port``).

- ``trading_vendor_429_total{source}``: 429s seen, ``broker`` (trades, and the broker's
  market data) or ``vendor`` (the fallback market data): the seed's ``vendor_429_total``;
- ``trading_ai_request_seconds{endpoint}``: each AI coach request (the seed's ``ai_request_ms``);
- ``trading_outbox_events_total{topic}``: events the family committed (``import.progress``,
  ``coach.reflect``, ``digest.ready``): the seed's ``event_outbox_writes_total``.

The seed's ``job_duration_ms{job, status}`` is the platform's
``conveyor_job_runtime_seconds{stage, status}``, and its ``queue_depth{queue}``
``conveyor_queue_length{queue_name}``.
"""

from __future__ import annotations

from conveyor import metrics

VENDOR_429 = metrics.counter("trading_vendor_429_total", "429 answers seen, by source", ["source"])
AI_SECONDS = metrics.histogram(
    "trading_ai_request_seconds",
    "AI coach requests, by endpoint",
    ["endpoint"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
)
OUTBOX_EVENTS = metrics.counter("trading_outbox_events_total", "events committed, by topic", ["topic"])


def saw_429(source: str) -> None:
    """Count one 429 of ``source`` (``broker`` or ``vendor``)."""
    VENDOR_429.labels(source=source).inc()


def ai_request(endpoint: str, seconds: float) -> None:
    """Observe one AI coach request."""
    AI_SECONDS.labels(endpoint=endpoint).observe(seconds)


def committed(topic: str, n: int = 1) -> None:
    """Count ``n`` events of ``topic`` the family committed."""
    if n:
        OUTBOX_EVENTS.labels(topic=topic).inc(n)


__all__ = ["ai_request", "committed", "saw_429"]
