"""Prometheus metrics (multiprocess mode so every pool child counts)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.runfile import local_pid, owner_id, pid_alive
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
        # Named by the lease owner's node and pid: a directory shared by hosts (or pods,
        # each with its worker as pid 1) holds one per worker, and only this node's are
        # judged by their pids.
        directory = base / f"worker-{owner_id().replace('/', '+')}"
        if base.is_dir():
            for old in base.glob("worker-*"):
                if old != directory and _gone(old.name.removeprefix("worker-")):
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


def _gone(name: str) -> bool:
    """Whether the worker a directory is named after no longer runs: a process of this
    node that is gone, or (a name of an older release: its bare pid) a pid not running here."""
    if name.isdigit():
        return not pid_alive(int(name))
    pid = local_pid(name.replace("+", "/"))
    return pid is not None and not pid_alive(pid)


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
