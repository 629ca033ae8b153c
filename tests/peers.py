"""Local peers for services we do not own, reached over their real protocols: an HTTP
embedding service, an OpenTelemetry collector (OTLP/HTTP)."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tasks.files.embedding import HashingEmbedder


class EmbeddingPeer:
    """An HTTP embedding service on a free local port; it can be told to answer 503."""

    def __init__(self) -> None:
        self.failing = False
        self.requests = 0
        self.refused = 0
        self._embedder = HashingEmbedder()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                peer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if peer.failing:
                    peer.refused += 1
                    self.send_response(503)
                    self.end_headers()
                    return
                answer = json.dumps({"vectors": peer._embedder.embed(body["texts"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/embed"


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[None]:
    """Serve ``server`` from a thread for the duration of the block, then close it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def embedding_peer() -> Iterator[EmbeddingPeer]:
    """Run an :class:`EmbeddingPeer` for the duration of the block."""
    peer = EmbeddingPeer()
    with serving(peer.server):
        yield peer


@dataclass(frozen=True)
class Received:
    """A span as the collector received it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class OtlpCollector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with a protobuf body."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _OtlpHandler)
        self.spans: list[Received] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def received(self) -> list[Received]:
        with self.lock:
            return list(self.spans)


class _OtlpHandler(BaseHTTPRequestHandler):
    server: OtlpCollector

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
                    attributes = {a.key: _otlp_value(a.value) for a in sp.attributes}
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


def _otlp_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@contextmanager
def otlp_collector() -> Iterator[OtlpCollector]:
    """Run an :class:`OtlpCollector` for the duration of the block."""
    collector = OtlpCollector()
    with serving(collector):
        yield collector
