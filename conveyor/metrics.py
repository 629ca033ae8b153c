"""Prometheus metrics (multiprocess mode so every pool child counts)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conveyor.settings import ConveyorSettings

COUNTERS = (
    "submitted",
    "claimed",
    "skipped",
    "retried",
    "dead",
    "stalled",
    "expired",
    "succeeded",
    "deduplicated",
    "preempted",
    "cancelled",
    "throttled",
)


class Metrics:
    """Counters per stage and a runtime histogram; a no-op until :meth:`enable` is called."""

    def __init__(self, settings: ConveyorSettings) -> None:
        self.settings = settings
        self._counters: dict[str, Any] = {}
        self._runtime: Any = None

    def enable(self) -> Path:
        """Create the metrics (before any pool child forks); returns their directory."""
        directory = self.settings.metrics_dir or (self.settings.resolved_home() / "metrics")
        directory.mkdir(parents=True, exist_ok=True)
        # prometheus_client picks multiprocess mode from this variable when metrics are made.
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(directory))
        from prometheus_client import Counter, Histogram

        for name in COUNTERS:
            self._counters[name] = Counter(f"conveyor_jobs_{name}_total", f"jobs {name}", ["stage"])
        self._runtime = Histogram("conveyor_job_runtime_seconds", "stage body runtime", ["stage"])
        return directory

    def inc(self, name: str, stage: str, amount: int = 1) -> None:
        """Count ``amount`` jobs of ``stage`` as ``name``."""
        counter = self._counters.get(name)
        if counter is not None:
            counter.labels(stage=stage).inc(amount)

    def observe_runtime(self, stage: str, seconds: float) -> None:
        """Record one body runtime."""
        if self._runtime is not None:
            self._runtime.labels(stage=stage).observe(seconds)


def serve(port: int, directory: str) -> None:
    """Serve the aggregated multiprocess metrics on ``port`` (a daemon thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    start_http_server(port, registry=registry)
