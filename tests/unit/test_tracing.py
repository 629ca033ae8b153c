"""conveyor.tracing with the OpenTelemetry API alone: carriers, headers, the settings."""

from __future__ import annotations

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
