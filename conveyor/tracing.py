"""Tracing: one OpenTelemetry trace per job, from its submit to its last continuation.

Conveyor uses only the OpenTelemetry *API* (a no-op until a process installs an SDK
``TracerProvider``). A submit opens a ``conveyor.client.submit`` span (a child of the caller's
current span, e.g. a web request's) and stores its context in the job row
(``jobs.trace_context``: a W3C ``traceparent``/``tracestate`` carrier), in the submit's own
transaction. Every publish and republish puts the row's context into the message headers
and makes it current while the message is sent, so a publish span of
``opentelemetry-instrumentation-celery`` joins the job's trace too. A worker parents its
``conveyor.claim`` and ``conveyor.run <stage>`` spans on the row's context, never on what
a message carried, so a message republished after a Redis wipe still joins the trace the
job started in; continuations record the context current at completion, so a whole flow
is one trace.

With ``CONVEYOR_TRACING=on`` a worker process installs an SDK provider (unless the
process has one) exporting over OTLP, and initialises the Celery instrumentation:
:func:`configure`. Its extras: ``pip install conveyor[telemetry]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from conveyor.settings import ConveyorSettings

log = logging.getLogger("conveyor.tracing")

TRACER = "conveyor"
# The row's carrier is always W3C trace context, whatever propagator the process uses.
_W3C = TraceContextTextMapPropagator()
_local = threading.local()
_configured = False
_configure_lock = threading.Lock()


def tracer() -> trace.Tracer:
    """Conveyor's tracer (from the global provider: a no-op one without an SDK)."""
    return trace.get_tracer(TRACER)


def carrier(ctx: Context | None = None) -> dict[str, str] | None:
    """The W3C carrier of ``ctx`` (default: the current context, or else the job this
    thread runs), or None when there is no valid span to record."""
    if ctx is None:
        ctx = _current_or_job()
    if ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    out: dict[str, str] = {}
    _W3C.inject(out, context=ctx)
    return out or None


def context_of(stored: Mapping[str, Any] | None) -> Context | None:
    """The context a stored carrier names; None if it names none (no span when submitted)."""
    if not stored or not isinstance(stored, Mapping):
        return None
    ctx = _W3C.extract({str(k): str(v) for k, v in stored.items()})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def headers(stored: Mapping[str, Any] | None) -> dict[str, str]:
    """Message headers that carry the stored context (the process's propagators)."""
    ctx = context_of(stored)
    out: dict[str, str] = {}
    if ctx is not None:
        propagate.inject(out, context=ctx)
    return out


@contextmanager
def attached(stored: Mapping[str, Any] | None) -> Iterator[None]:
    """Make the stored context current inside the block (a publish: instrumentation that
    starts a span there, and injects it into the headers, stays in the job's trace)."""
    ctx = context_of(stored)
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def span(
    name: str,
    *,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Iterator[Span]:
    """A current span named ``name``: a child of ``parent``, else of the current span,
    else of the job this thread runs (a chord body submitted after the run's span ended)."""
    ctx = parent if parent is not None else _current_or_job()
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) and (
        ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid
    ):
        # No SDK and no span to continue: the API's no-op tracer would make an invalid
        # span current, which is what is current already. About 25 us per span saved
        # on every job's path (issue #16).
        yield trace.INVALID_SPAN
        return
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with tracer().start_as_current_span(
        name,
        context=ctx,
        kind=kind,
        attributes=attrs,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        yield current


def run_parent(stored: Mapping[str, Any] | None) -> Context | None:
    """The parent of a run's spans: the job row's context. When the current span is in the
    same trace (the Celery instrumentation's task span, built from the headers Conveyor
    injected), the run nests inside it."""
    ctx = context_of(stored)
    if ctx is None:
        return None
    current = trace.get_current_span().get_span_context()
    row = trace.get_current_span(ctx).get_span_context()
    if current.is_valid and current.trace_id == row.trace_id:
        return otel_context.get_current()
    return ctx


def record_claim(
    stage: str, job_id: str, stored: Mapping[str, Any] | None, started_ns: int, outcome: str
) -> None:
    """A finished ``conveyor.claim`` span from ``started_ns`` to now, parented on the row's
    context (known only once the claim returned the row)."""
    ctx = run_parent(stored)
    if ctx is None:
        return
    attrs = {"conveyor.stage": stage, "conveyor.job_id": job_id, "conveyor.claim.outcome": outcome}
    claim = tracer().start_span("conveyor.claim", context=ctx, attributes=attrs, start_time=started_ns)
    claim.end()


def now_ns() -> int:
    """A span timestamp (``start_time`` of a span recorded after the fact)."""
    return time.time_ns()


def failed(current: Span, exc: BaseException) -> None:
    """Mark ``current`` as failed by ``exc``."""
    current.record_exception(exc)
    current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))


def set_job_context(ctx: Context | None = None) -> None:
    """The context of the job this thread runs (default: the current one), until
    :func:`clear_job_context`: jobs this thread submits with no span current (Celery fires
    a chord body after the run's span ended) join its trace."""
    _local.job = ctx if ctx is not None else otel_context.get_current()


def clear_job_context(**_: Any) -> None:
    """Forget the job this thread ran (a ``task_postrun`` receiver)."""
    _local.job = None


def _current_or_job() -> Context | None:
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    job: Context | None = getattr(_local, "job", None)
    return job


def ids() -> tuple[str, str] | None:
    """The current span's ``(trace_id, span_id)`` in hex, or None without a span."""
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


# -- set-up in Conveyor's own processes ---------------------------------------------------


def configure(settings: ConveyorSettings) -> bool:
    """With ``settings.tracing`` on: install an SDK provider exporting over OTLP (unless
    the process has a provider already) and instrument Celery. Returns whether tracing is
    on in this process. Needs the ``telemetry`` extra; without it, a warning."""
    global _configured
    if settings.tracing != "on":
        return False
    with _configure_lock:
        if _configured:
            return True
        try:
            _install_provider(settings)
        except ImportError as exc:
            log.warning("CONVEYOR_TRACING is on but the OpenTelemetry SDK is missing (%s): "
                        "pip install 'conveyor[telemetry]'", exc)  # fmt: skip
            return False
        _instrument_celery()
        _configured = True
        return True


def _install_provider(settings: ConveyorSettings) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # the process (an app, a test) installed its own: spans go there
    provider = TracerProvider(resource=Resource.create({"service.name": settings.tracing_service_name}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("no OTLP exporter installed (opentelemetry-exporter-otlp-proto-http): spans are dropped")
    else:
        # The exporter reads the SDK's OTEL_EXPORTER_OTLP_* variables when no endpoint is set.
        endpoint = settings.otlp_endpoint
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def _instrument_celery() -> None:
    try:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
    except ImportError:
        log.info("opentelemetry-instrumentation-celery not installed: Conveyor's own spans only")
        return
    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


__all__ = [
    "attached",
    "carrier",
    "clear_job_context",
    "configure",
    "context_of",
    "failed",
    "headers",
    "ids",
    "now_ns",
    "record_claim",
    "run_parent",
    "set_job_context",
    "span",
    "tracer",
]
