"""conveyor.tracing with the OpenTelemetry API alone: carriers, headers, the settings."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry import trace

from conveyor import tracing
from conveyor.settings import ConveyorSettings

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_span_no_carrier_and_no_headers() -> None:
    assert tracing.carrier() is None
    assert tracing.context_of(None) is None and tracing.context_of({}) is None
    assert tracing.context_of({"traceparent": "garbage"}) is None
    assert tracing.headers(None) == {}


def test_a_stored_carrier_round_trips_into_headers_and_the_current_context() -> None:
    stored = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    assert tracing.headers(stored)["traceparent"] == TRACEPARENT
    with tracing.attached(stored):
        current = trace.get_current_span().get_span_context()
        assert format(current.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
        assert tracing.carrier() == stored
        assert tracing.ids() == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    assert tracing.carrier() is None


def test_a_thread_running_a_job_submits_into_its_trace_until_cleared() -> None:
    ctx = tracing.context_of({"traceparent": TRACEPARENT})
    tracing.set_job_context(ctx)
    try:
        assert tracing.carrier() == {"traceparent": TRACEPARENT}
    finally:
        tracing.clear_job_context()
    assert tracing.carrier() is None


def test_tracing_setting_defaults_off_and_configure_leaves_the_process_alone() -> None:
    settings = ConveyorSettings()
    assert settings.tracing == "off" and settings.otlp_endpoint is None
    assert tracing.configure(settings) is False
    assert ConveyorSettings(tracing="on").tracing == "on"


ON = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
{block}
from opentelemetry import trace
from conveyor import tracing
from conveyor.settings import ConveyorSettings
on = tracing.configure(ConveyorSettings(tracing="on", otlp_endpoint="http://127.0.0.1:9/v1/traces"))
print("configured", on, type(trace.get_tracer_provider()).__name__)
with tracing.span("conveyor.submit"):
    print("carrier", tracing.carrier() is not None)
try:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    print("celery instrumented", CeleryInstrumentor().is_instrumented_by_opentelemetry)
except ImportError:
    print("celery instrumented", None)
sys.stdout.flush()
import os
os._exit(0)  # no exit-time export to the closed port (the exporter would retry for seconds)
"""
# Makes the SDK unimportable, as in an install without the telemetry extra.
NO_SDK = """
import importlib.abc
class NoSdk(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.instrumentation")):
            raise ImportError(name)
sys.meta_path.insert(0, NoSdk())
"""


def _run(block: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", ON.format(block=block)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_tracing_on_installs_the_sdk_and_instruments_celery() -> None:
    out = _run("")
    assert "configured True TracerProvider" in out and "carrier True" in out
    assert "celery instrumented True" in out


def test_tracing_on_without_the_sdk_warns_and_conveyor_runs_on_the_api() -> None:
    out = _run(NO_SDK)
    assert any("pip install 'conveyor[telemetry]'" in line for line in out), out
    assert "configured False ProxyTracerProvider" in out and "carrier False" in out
    assert "celery instrumented None" in out


class _Worker:
    """What ``worker_init`` sends: a worker (hashable, unlike a namespace)."""

    def __init__(self, pool_cls: object) -> None:
        self.pool_cls = pool_cls


def test_a_worker_sets_tracing_up_where_its_tasks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from celery import signals
    from celery.concurrency.prefork import TaskPool as Prefork
    from celery.concurrency.solo import TaskPool as Solo

    from conveyor.worker.step import install_tracing

    calls: list[str] = []
    monkeypatch.setattr(tracing, "configure", lambda settings: calls.append(settings.tracing))
    off = install_tracing(SimpleNamespace(settings=ConveyorSettings()))
    on = install_tracing(SimpleNamespace(settings=ConveyorSettings(tracing="on")))
    try:
        signals.worker_init.send(sender=_Worker(Prefork))
        signals.worker_init.send(sender=_Worker("prefork"))
        assert calls == []  # a prefork parent runs no task: its children set it up
        signals.worker_process_init.send(sender=None)
        signals.worker_init.send(sender=_Worker(Solo))
        signals.worker_init.send(sender=_Worker("threads"))
        assert calls == ["on", "on", "on"]
    finally:
        on()
        off()
