"""Prometheus metrics (multiprocess mode so every pool child counts).

``prometheus_client`` picks multiprocess mode when a metric is first made, from the
environment :meth:`Metrics.enable` sets: a family's module must not make its metrics at
import. It declares them with :func:`counter` and :func:`histogram` instead, which make
nothing until metrics are enabled and then the real metric once per process, on first use.
"""

from __future__ import annotations

import os
import shutil
import threading
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
    "deferred",
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
        global _enabled
        _enabled = True  # pool children, forked later, inherit it
        from prometheus_client import Counter, Histogram

        for name in COUNTERS:
            self._counters[name] = Counter(f"conveyor_jobs_{name}_total", f"jobs {name}", ["stage"])
        self._runtime = Histogram("conveyor_job_runtime_seconds", "stage body runtime", ["stage", "status"])
        return directory

    def inc(self, name: str, stage: str, amount: int = 1) -> None:
        """Count ``amount`` jobs of ``stage`` as ``name``."""
        counter = self._counters.get(name)
        if counter is not None:
            counter.labels(stage=stage).inc(amount)

    def observe_runtime(self, stage: str, seconds: float, status: str = "ok") -> None:
        """Record one body runtime: ``status`` is ``ok`` when the body returned (the job
        succeeded or was skipped), ``err`` when it raised a failure of the job (retried or
        dead-lettered). A deferral, a preemption or cancellation, a worker's stop and
        Conveyor's own outage are not the body's outcome and are not recorded."""
        if self._runtime is not None:
            self._runtime.labels(stage=stage, status=status).observe(seconds)


_enabled = False


class _NoOp:
    """What a lazy metric is while metrics are off: accepts every call, records nothing."""

    def labels(self, *args: Any, **labels: Any) -> _NoOp:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_NOOP = _NoOp()


class LazyMetric:
    """A Prometheus metric made on first use in each process, once metrics are enabled;
    a no-op before (:func:`counter`, :func:`histogram`)."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str], **extra: Any):
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames = tuple(labelnames)
        self.extra = extra
        self._made: tuple[int, Any] | None = None
        self._lock = threading.Lock()

    def _metric(self) -> Any:
        if not _enabled:
            return _NOOP
        made = self._made
        if made is not None and made[0] == os.getpid():
            return made[1]
        with self._lock:
            if self._made is None or self._made[0] != os.getpid():
                import prometheus_client

                cls = getattr(prometheus_client, self.kind)
                # No registry: the multiprocess collector reads the files, and a second
                # process-local copy must not clash in the default registry.
                metric = cls(self.name, self.documentation, self.labelnames, registry=None, **self.extra)
                self._made = (os.getpid(), metric)
            return self._made[1]

    def labels(self, **labels: str) -> Any:
        """The child of these label values (a no-op while metrics are off)."""
        return self._metric().labels(**labels)

    def inc(self, amount: float = 1) -> None:
        """Count ``amount`` (a metric without labels)."""
        self._metric().inc(amount)

    def observe(self, amount: float) -> None:
        """Observe ``amount`` (a histogram without labels)."""
        self._metric().observe(amount)


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> LazyMetric:
    """A counter made only once metrics are enabled, per process (see the module's doc)."""
    return LazyMetric("Counter", name, documentation, labelnames)


def histogram(
    name: str, documentation: str, labelnames: Sequence[str] = (), buckets: Sequence[float] | None = None
) -> LazyMetric:
    """A histogram made only once metrics are enabled, per process (see the module's doc)."""
    extra = {"buckets": tuple(buckets)} if buckets is not None else {}
    return LazyMetric("Histogram", name, documentation, labelnames, **extra)


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
