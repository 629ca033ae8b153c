"""A family's metrics (conveyor.metrics.counter/histogram) make nothing until metrics are
enabled, then one real metric per process on first use (prometheus_client picks its
multiprocess mode when a metric is first made, so none may be made at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor import metrics


def test_a_lazy_metric_is_a_no_op_until_metrics_are_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_enabled", False)
    sent = metrics.counter("conveyor_test_lazy_total", "a test counter", ["provider"])
    sent.labels(provider="smtp").inc()
    metrics.histogram("conveyor_test_lazy_seconds", "a test histogram").observe(0.5)
    assert sent._made is None


def test_enabled_it_counts_in_multiprocess_mode_per_process(tmp_path: Path) -> None:
    # Its own process: enabling sets the multiprocess directory for the whole process.
    script = f"""
import os, sys
from conveyor import metrics
from conveyor.settings import ConveyorSettings
sent = metrics.counter("conveyor_test_lazy_total", "a test counter", ["provider"])
assert "prometheus_client" not in sys.modules or sent._made is None
directory = metrics.Metrics(ConveyorSettings(metrics_dir={str(tmp_path)!r})).enable()
sent.labels(provider="smtp").inc(2)
pid = os.fork()
if pid == 0:
    sent.labels(provider="smtp").inc(3)  # the child makes its own
    os._exit(0)
os.waitpid(pid, 0)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry, path=str(directory))
print(generate_latest(registry).decode())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert 'conveyor_test_lazy_total{provider="smtp"} 5.0' in out.stdout
