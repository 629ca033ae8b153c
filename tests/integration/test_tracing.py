"""One OpenTelemetry trace per job, recorded by an in-memory exporter against a real worker.

The global tracer provider can be set once per process: this module sets a switchable one
(an SDK provider behind it, with a ``SimpleSpanProcessor`` into an
``InMemorySpanExporter``) the first time it runs, and turns it on only for its own tests.
Switched off, every tracer is the API's no-op one: the rest of the session runs as if no
SDK were installed.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from celery import chain, chord
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tasks.demo as demo
from conveyor import tracing
from conveyor.logs import configure_logging
from conveyor.settings import ConveyorSettings
from conveyor.store.db import schema as s
from tests.helpers import eventually, job_row
from tests.unit.test_logs import restore_logging  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)


class Switchable(trace.TracerProvider):
    """The process's provider: the SDK's while on, the API's no-op tracer while off."""

    def __init__(self) -> None:
        self.sdk = TracerProvider()
        self.exporter = InMemorySpanExporter()
        self.sdk.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.on = False

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self.sdk.get_tracer(*args, **kwargs) if self.on else trace.NoOpTracer()


def _provider() -> Switchable:
    current = trace.get_tracer_provider()
    if isinstance(current, Switchable):
        return current
    switchable = Switchable()
    trace.set_tracer_provider(switchable)
    if trace.get_tracer_provider() is not switchable:
        pytest.skip("this process already has a tracer provider")
    return switchable


@pytest.fixture
def spans() -> Iterator[Switchable]:
    """Spans recorded for this test only (cleared before, switched off after)."""
    provider = _provider()
    provider.exporter.clear()
    provider.on = True
    try:
        yield provider
    finally:
        provider.on = False
        provider.exporter.clear()


def _finished(provider: Switchable) -> Sequence[ReadableSpan]:
    return provider.exporter.get_finished_spans()


def _named(provider: Switchable, name: str, job_id: str) -> ReadableSpan:
    found = [
        sp
        for sp in _finished(provider)
        if sp.name == name and (sp.attributes or {}).get("conveyor.job_id") == job_id
    ]
    assert found, f"no {name} span of job {job_id}: {[sp.name for sp in _finished(provider)]}"
    return found[-1]


def _ended(provider: Switchable, name: str, job_id: str) -> ReadableSpan:
    """The span once it ended (a run's span ends after its completion's, and after the
    job's row says it succeeded)."""

    def found() -> bool:
        return any(
            sp.name == name and (sp.attributes or {}).get("conveyor.job_id") == job_id
            for sp in _finished(provider)
        )

    eventually(found, timeout=10)
    return _named(provider, name, job_id)


def _parent_id(sp: ReadableSpan) -> int | None:
    return sp.parent.span_id if sp.parent is not None else None


def _span_id(sp: ReadableSpan) -> int:
    assert sp.context is not None
    return sp.context.span_id


def _trace_id(sp: ReadableSpan) -> int:
    assert sp.context is not None
    return sp.context.trace_id


def _stored_trace(platform: Any, job_id: str) -> tuple[int, int]:
    """(trace id, span id) of the context a job row keeps."""
    carrier = job_row(platform, job_id)["trace_context"]
    assert carrier and carrier["traceparent"].startswith("00-")
    _, trace_hex, span_hex, _ = carrier["traceparent"].split("-")
    return int(trace_hex, 16), int(span_hex, 16)


def test_a_chain_submitted_in_a_request_span_is_one_trace(platform: Any, worker: Any, spans: Any) -> None:
    tracer = spans.sdk.get_tracer("a web app")
    with tracer.start_as_current_span("GET /orders") as request:
        result = chain(demo.square_stage.s(n=3), demo.square_stage.s()).apply_async()
    last = platform.job(result.id)
    eventually(lambda: job_row(platform, last.id) is not None, timeout=30)
    assert last.wait(30) == s.SUCCEEDED
    first_id = job_row(platform, last.id)["parent_id"]
    trace_id = request.get_span_context().trace_id

    # The flow's own spans: a job of an earlier test falling due meanwhile records its own.
    flow = {first_id, last.id}

    def of_flow() -> list[ReadableSpan]:
        return [sp for sp in _finished(spans) if (sp.attributes or {}).get("conveyor.job_id") in flow]

    def ended() -> bool:
        names = [sp.name for sp in of_flow()]
        return "conveyor.complete" in names and names.count("conveyor.run conveyor.demo.square") == 2

    eventually(ended, timeout=10)
    # Every span of the flow is in the request's trace.
    assert {_trace_id(sp) for sp in of_flow()} == {trace_id}

    # The first job: submitted inside the request, claimed and run under its submit.
    submit1 = _named(spans, "conveyor.submit", first_id)
    assert _parent_id(submit1) == request.get_span_context().span_id
    assert _stored_trace(platform, first_id) == (trace_id, _span_id(submit1))
    claim1 = _named(spans, "conveyor.claim", first_id)
    run1 = _named(spans, "conveyor.run conveyor.demo.square", first_id)
    assert _parent_id(claim1) == _parent_id(run1) == _span_id(submit1)
    assert (claim1.attributes or {})["conveyor.claim.outcome"] == "run"
    complete1 = _named(spans, "conveyor.complete", first_id)
    assert _parent_id(complete1) == _span_id(run1)

    # The next link: submitted as a child of the first job's completion, in its transaction.
    submit2 = _named(spans, "conveyor.submit", last.id)
    assert _parent_id(submit2) == _span_id(complete1)
    assert _stored_trace(platform, last.id) == (trace_id, _span_id(submit2))
    run2 = _named(spans, "conveyor.run conveyor.demo.square", last.id)
    assert _parent_id(run2) == _span_id(submit2)
    assert _parent_id(_named(spans, "conveyor.complete", last.id)) == _span_id(run2)


def test_a_chord_body_joins_the_trace_of_its_members(platform: Any, worker: Any, spans: Any) -> None:
    with spans.sdk.get_tracer("a web app").start_as_current_span("POST /report") as request:
        result = chord([demo.square_stage.si(n=2), demo.square_stage.si(n=3)], demo.square_stage.si(n=4))()
    body = platform.job(result.id)
    eventually(lambda: job_row(platform, body.id) is not None, timeout=30)
    assert body.wait(30) == s.SUCCEEDED
    trace_id = request.get_span_context().trace_id
    # Celery submits the body after the last member's run span ended, from the worker's
    # thread: the submit is still a child of that member's run.
    submit = _named(spans, "conveyor.submit", body.id)
    runs = [sp for sp in _finished(spans) if sp.name == "conveyor.run conveyor.demo.square"]
    assert _trace_id(submit) == trace_id and _parent_id(submit) in {_span_id(r) for r in runs}
    assert _stored_trace(platform, body.id) == (trace_id, _span_id(submit))


def test_a_message_lost_with_redis_is_republished_into_the_same_trace(
    platform: Any, worker: Any, spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = platform.connections.broker
    sent: list[dict[str, Any]] = []
    # The message never reaches Redis, though the row says it was published (the Redis
    # that held it is wiped below): only the relay's republish can deliver it.
    monkeypatch.setattr(broker, "publish", lambda **kw: sent.append(kw) or kw.get("task_id"))
    with spans.sdk.get_tracer("a script").start_as_current_span("nightly") as caller:
        handle = platform.submit("conveyor.demo.square", {"n": 5})
    monkeypatch.undo()
    assert sent and sent[0]["trace_context"] == job_row(platform, handle.id)["trace_context"]
    trace_id = caller.get_span_context().trace_id
    assert job_row(platform, handle.id)["published_at"] is not None

    # Redis wiped: the epoch, the bindings and the queues gone (the worker's own keys are
    # spared). The relay declares the queues again, makes a new epoch and republishes what
    # was published under the old one.
    r = platform.redis
    queues = [key for q in platform.queues for key in r.scan_iter(f"{q.name}*")]
    r.delete(broker.epoch_key, *r.scan_iter("_kombu.binding.*"), *queues)
    assert handle.wait(30) == s.SUCCEEDED
    assert job_row(platform, handle.id)["celery_task_id"] != sent[0]["task_id"]

    run = _ended(spans, "conveyor.run conveyor.demo.square", handle.id)
    mine = [sp for sp in _finished(spans) if _trace_id(sp) == trace_id]
    submit = _named(spans, "conveyor.submit", handle.id)
    assert submit in mine and run in mine and _named(spans, "conveyor.claim", handle.id) in mine
    assert _parent_id(run) == _span_id(submit)
    assert _stored_trace(platform, handle.id) == (trace_id, _span_id(submit))


def test_a_line_logged_in_a_body_carries_the_run_spans_ids(
    platform: Any,
    worker: Any,
    spans: Any,
    restore_logging: None,  # noqa: F811
) -> None:
    buf = io.StringIO()
    configure_logging(ConveyorSettings(log_format="json", log_level="WARNING"), stream=buf)
    handle = platform.submit("conveyor.demo.logged", {"n": 11})
    assert handle.wait(30) == s.SUCCEEDED
    eventually(lambda: "logged 11" in buf.getvalue(), timeout=10)
    [line] = [json.loads(x) for x in buf.getvalue().splitlines() if '"logged 11"' in x]
    run = _ended(spans, "conveyor.run conveyor.demo.logged", handle.id)
    assert line["trace_id"] == format(_trace_id(run), "032x")
    assert line["span_id"] == format(_span_id(run), "016x")
    assert line["job_id"] == handle.id
    logging.getLogger("conveyor.test").warning("outside any span")
    [outside] = [json.loads(x) for x in buf.getvalue().splitlines() if "outside any span" in x]
    assert "trace_id" not in outside and "span_id" not in outside


def test_without_a_provider_nothing_is_stored_and_jobs_still_run(platform: Any, worker: Any) -> None:
    assert tracing.carrier() is None
    handle = platform.submit("conveyor.demo.square", {"n": 4})
    assert handle.wait(30) == s.SUCCEEDED
    assert job_row(platform, handle.id)["trace_context"] is None


def test_celery_instrumentation_spans_join_the_jobs_trace(platform: Any, worker: Any, spans: Any) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=spans.sdk)
    try:
        with spans.sdk.get_tracer("a web app").start_as_current_span("POST /squares") as request:
            handle = platform.submit("conveyor.demo.square", {"n": 6})
        assert handle.wait(30) == s.SUCCEEDED
        # The task span ends in task_postrun, after the job's own spans.
        eventually(lambda: any(sp.name.startswith("run/") for sp in _finished(spans)), timeout=10)
    finally:
        instrumentor.uninstrument()
    trace_id = request.get_span_context().trace_id
    names = {sp.name: sp for sp in _finished(spans) if _trace_id(sp) == trace_id}
    # The instrumentation's publish span (it hooks send_task_message's signal) and task span
    # are in the job's trace; the run nests inside the task span the headers gave it.
    publish, task = names["apply_async/conveyor.demo.square"], names["run/conveyor.demo.square"]
    submit = _named(spans, "conveyor.submit", handle.id)
    assert _parent_id(publish) == _span_id(submit)
    assert _parent_id(task) == _span_id(publish)
    assert _parent_id(_named(spans, "conveyor.run conveyor.demo.square", handle.id)) == _span_id(task)
    assert _parent_id(_named(spans, "conveyor.claim", handle.id)) == _span_id(task)


@pytest.mark.sqlite
def test_on_sqlite_the_row_keeps_the_submits_context(on_sqlite: Any, spans: Any) -> None:
    platform = on_sqlite
    with spans.sdk.get_tracer("a script").start_as_current_span("import"):
        handle = platform.submit("conveyor.demo.square", {"n": 2}, delay=3600)
    submit = _named(spans, "conveyor.submit", handle.id)
    assert _stored_trace(platform, handle.id) == (_trace_id(submit), _span_id(submit))
    platform.cancel(handle.id)


def test_a_submit_over_http_joins_the_callers_trace(platform: Any, spans: Any, tag: str) -> None:
    from fastapi.testclient import TestClient

    import conveyor
    from conveyor.client import registry
    from conveyor.web import create_app, tokens

    registry.write(platform.engine, platform.stages.values())
    secret = tokens.create(platform.engine, owner=f"t{tag}", scopes=("submit",)).secret
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    c = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    try:
        with TestClient(create_app(c)) as http:
            made = http.post(
                "/jobs",
                json={"stage": "conveyor.demo.square", "payload": {"n": 2}, "delay": 60},
                headers={
                    "Authorization": f"Bearer {secret}",
                    "traceparent": f"00-{caller_trace}-{caller_span}-01",
                },
            )
    finally:
        c.close()
    assert made.status_code == 201, made.text
    trace_id, _ = _stored_trace(platform, made.json()["id"])
    assert trace_id == int(caller_trace, 16)
    submit = _named(spans, "conveyor.submit", made.json()["id"])
    assert _parent_id(submit) == int(caller_span, 16)
