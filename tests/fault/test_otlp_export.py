"""Tracing over the wire: a prefork worker with ``CONVEYOR_TRACING=on`` exports its spans
from its pool children (whose exporter thread starts after the fork) over OTLP/HTTP to a
collector, here a local one that decodes the protocol's protobuf; a chain submitted inside
a caller's span arrives there as one trace, the caller's, with the workers' ``service.name``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import tasks.demo as demo
from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn
from tests.helpers import eventually, job_row
from tests.peers import OtlpCollector, Received, otlp_collector

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]


@pytest.fixture
def collector() -> Iterator[OtlpCollector]:
    with otlp_collector() as peer:
        yield peer


def test_workers_export_a_chains_spans_over_otlp_into_the_callers_trace(
    platform: Any, spawn: Spawn, collector: OtlpCollector, tag: str
) -> None:
    service = f"workers-{tag}"
    spawn(
        concurrency=2,
        env={
            "CONVEYOR_TRACING": "on",
            "CONVEYOR_OTLP_ENDPOINT": collector.endpoint,
            "CONVEYOR_TRACING_SERVICE_NAME": service,
        },
    )
    # The caller: a provider of its own (not the process's global one), exporting to the
    # same collector, as a web app's instrumentation would.
    caller = TracerProvider(resource=Resource.create({"service.name": f"app-{tag}"}))
    caller.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.endpoint)))
    with caller.get_tracer("a web app").start_as_current_span("POST /orders") as request:
        result = chain(demo.square_stage.s(n=3), demo.square_stage.s()).apply_async()
    caller.shutdown()
    last = platform.job(result.id)
    eventually(lambda: job_row(platform, last.id) is not None, timeout=30)
    assert last.wait(60) == s.SUCCEEDED
    first = str(job_row(platform, last.id)["parent_id"])
    trace_id = f"{request.get_span_context().trace_id:032x}"

    def of_flow() -> list[Received]:
        return [sp for sp in collector.received() if sp.attributes.get("conveyor.job_id") in {first, last.id}]

    def exported() -> list[Received] | None:
        names = [sp.name for sp in of_flow()]
        runs = names.count("conveyor.run conveyor.demo.square")
        return of_flow() if runs == 2 and names.count("conveyor.complete") == 2 else None

    flow = eventually(exported, timeout=30)  # a BatchSpanProcessor sends every 5 s
    assert {sp.trace_id for sp in flow} == {trace_id}
    assert {sp.service for sp in flow} == {service}
    run_of = {sp.attributes["conveyor.job_id"]: sp for sp in flow if sp.name.startswith("conveyor.run ")}
    claims = [sp for sp in flow if sp.name == "conveyor.claim"]
    assert {sp.attributes["conveyor.claim.outcome"] for sp in claims} == {"run"}
    assert {sp.parent_id for sp in claims} == {run_of[first].parent_id, run_of[last.id].parent_id}
    requests = [sp for sp in collector.received() if sp.name == "POST /orders"]
    assert [(sp.trace_id, sp.service) for sp in requests] == [(trace_id, f"app-{tag}")]
