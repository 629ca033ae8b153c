"""Tracing over the wire: a prefork worker with ``CONVEYOR_TRACING=on`` exports its spans
from its pool children (whose exporter thread starts after the fork) over OTLP/HTTP to a
collector, here a local one that decodes the protocol's protobuf; a chain submitted inside
a caller's span arrives there as one trace, the caller's, with the workers' ``service.name``."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from celery import chain
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import tasks.demo as demo
from conveyor.db import schema as s
from tests.fault.conftest import Spawn
from tests.helpers import eventually, job_row

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]


@dataclass(frozen=True)
class Received:
    """A span as the collector received it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with a protobuf body."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[Received] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def received(self) -> list[Received]:
        with self.lock:
            return list(self.spans)


class _Handler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(415)
            return
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for sp in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in sp.attributes}
                    spans.append(
                        Received(
                            resource.get("service.name", ""),
                            sp.name,
                            sp.trace_id.hex(),
                            sp.span_id.hex(),
                            sp.parent_span_id.hex(),
                            attributes,
                        )
                    )
        with self.server.lock:
            self.server.spans.extend(spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_workers_export_a_chains_spans_over_otlp_into_the_callers_trace(
    platform: Any, spawn: Spawn, collector: Collector, tag: str
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
