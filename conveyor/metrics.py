"""Prometheus metrics (multiprocess mode so every pool child counts)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
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
        """Create the metrics (before any pool child forks); returns their directory: one
        of this worker's own, so counters start at zero with each worker (as Prometheus
        expects of a restarted process), the directories of workers no longer running
        removed."""
        base = self.settings.metrics_dir or (self.settings.resolved_home() / "metrics")
        directory = base / f"worker-{os.getpid()}"
        if base.is_dir():
            for old in base.glob("worker-*"):
                if old != directory and not _alive(old.name.removeprefix("worker-")):
                    shutil.rmtree(old, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        # prometheus_client picks multiprocess mode from this variable when metrics are made;
        # pool children inherit it.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
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


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a directory name's) still runs on this host."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(port: int, directory: str, collectors: Sequence[Any] = ()) -> None:
    """Serve the aggregated multiprocess metrics, and ``collectors`` (read at scrape time),
    on ``port`` (a daemon thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    for collector in collectors:
        registry.register(collector)
    start_http_server(port, registry=registry)
