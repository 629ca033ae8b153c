"""Structured logs: one renderer for structlog and stdlib records, job fields, redaction."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from billiard import util as billiard_util
from celery import signals

from conveyor.logs import (
    HANDLER_NAME,
    bind_job,
    configure_logging,
    configure_logging_on_first_record,
    job_context,
    redact_text,
    redact_value,
    unbind_job,
)
from conveyor.settings import ConveyorSettings
from conveyor.worker.context import JobContext
from conveyor.worker.step import use_conveyor_logging

NO_PLATFORM: Any = object()  # a JobContext uses its platform only once asked for a connection
SECRETS = ("s3cret", "hunter2", "pw-in-url", "tok-nested", "abcdef123456", "alice.smith")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the root logger, billiard's logger and structlog back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    mp = logging.getLogger("multiprocessing")
    mp_state = (mp.propagate, mp.level, billiard_util._logger)
    configured, config = structlog.is_configured(), structlog.get_config()
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    mp.propagate, mp.level, billiard_util._logger = mp_state
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


def capture(log_format: Any, *, level: str = "INFO") -> io.StringIO:
    """Configure Conveyor's logging into a buffer."""
    buf = io.StringIO()
    configure_logging(ConveyorSettings(log_format=log_format, log_level=level), stream=buf)
    return buf


def json_lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def emit_secrets() -> None:
    """Secrets through both APIs: kwargs, nested values, URLs, headers, an address."""
    logging.getLogger("conveyor.x").warning("connect %s", "redis://:s3cret@h:1")
    logging.getLogger("conveyor.x").info("login as alice.smith@example.com with password=hunter2")
    structlog.get_logger("conveyor.y").info(
        "calling the api",
        password="hunter2",
        user="visible-user",
        options={"retries": 3, "credentials": {"key": "s3cret"}, "items": [{"api_token": "tok-nested"}]},
        database="postgresql://app:pw-in-url@db.internal/prod",
        headers={"Accept": "text/plain", "X-Note": "Authorization: Bearer abcdef123456"},
        contact="alice.smith@example.com",
    )


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_secrets_never_reach_the_rendered_output(restore_logging: None, log_format: str) -> None:
    buf = capture(log_format)
    emit_secrets()
    out = buf.getvalue()
    for secret in SECRETS:
        assert secret not in out
    for kept in ("connect redis://:***@h:1", "visible-user", "retries", "text/plain", "Bearer ***"):
        assert kept in out
    assert "postgresql://app:***@db.internal/prod" in out
    assert "***@example.com" in out  # the domain stays, the person goes


def test_json_lines_are_valid_and_redacted_values_are_masked(restore_logging: None) -> None:
    buf = capture("json")
    emit_secrets()
    lines = json_lines(buf)
    assert [line["event"] for line in lines] == [
        "connect redis://:***@h:1",
        "login as ***@example.com with password=***",
        "calling the api",
    ]
    structured = lines[2]
    assert structured["password"] == "***"
    assert structured["options"]["credentials"] == "***"
    assert structured["options"]["items"] == [{"api_token": "***"}]
    assert structured["options"]["retries"] == 3
    assert {structured["logger"], structured["level"]} == {"conveyor.y", "info"}
    assert lines[0]["logger"] == "conveyor.x" and lines[0]["level"] == "warning"
    assert lines[0]["timestamp"].endswith("Z")


def test_bound_job_fields_are_on_every_json_line_until_unbound(restore_logging: None) -> None:
    buf = capture("json")
    tokens = bind_job("job-1", "conveyor.demo.square", 2, "demo")
    logging.getLogger("conveyor.runner").info("stdlib line")
    structlog.get_logger("conveyor.y").info("structlog line")
    unbind_job(tokens)
    logging.getLogger("conveyor.runner").info("after")
    lines = json_lines(buf)
    for line in lines[:2]:
        assert (line["job_id"], line["stage"], line["attempt"], line["queue"]) == (
            "job-1",
            "conveyor.demo.square",
            2,
            "demo",
        )
    assert "job_id" not in lines[2]


def test_tracebacks_are_rendered_and_scrubbed(restore_logging: None) -> None:
    buf = capture("json")
    try:
        raise ConnectionError("cannot reach postgresql://u:s3cret@db/x for alice.smith@example.com")
    except ConnectionError:
        logging.getLogger("conveyor.x").exception("stdlib failed")
        structlog.get_logger("conveyor.y").exception("structlog failed")
    lines = json_lines(buf)
    assert len(lines) == 2
    for line in lines:
        assert "Traceback" in line["exception"] and "ConnectionError" in line["exception"]
        assert "postgresql://u:***@db/x" in line["exception"]
    assert "s3cret" not in buf.getvalue() and "alice.smith" not in buf.getvalue()


def test_level_and_reconfiguring_keep_one_handler(restore_logging: None) -> None:
    capture("console", level="WARNING")
    buf = capture("json", level="WARNING")
    logging.getLogger("conveyor.x").info("hidden")
    structlog.get_logger("conveyor.x").info("hidden too")
    logging.getLogger("conveyor.x").warning("shown")
    assert [line["event"] for line in json_lines(buf)] == ["shown"]
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1


def test_log_level_setting_is_validated() -> None:
    assert ConveyorSettings(log_level="warning").log_level == "WARNING"
    with pytest.raises(ValueError, match="unknown log level"):
        ConveyorSettings(log_level="loud")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("postgresql://user:pw@host/db", "postgresql://user:***@host/db"),
        ("postgresql://postgres@127.0.0.1:5432/db", "postgresql://postgres@127.0.0.1:5432/db"),
        ("Authorization: Bearer abc.def-ghi", "Authorization: Bearer ***"),
        ("curl -H 'Authorization: Basic dXNlcjpwYXNz'", "curl -H 'Authorization: Basic ***'"),
        ("sent bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "sent bearer ***"),
        ("GET /cb?token=abc&page=2&password=p%40ss", "GET /cb?token=***&page=2&password=***"),
        ("{'password': 'correct horse', 'n': 1}", "{'password': '***', 'n': 1}"),
        ('{"api_key": "xyz"}', '{"api_key": "***"}'),
        ("mail bob.smith+x@mail.example.org now", "mail ***@mail.example.org now"),
        ("Task conveyor.demo.effect[5e1c] received", "Task conveyor.demo.effect[5e1c] received"),
        ("Connected to redis://127.0.0.1:6379/1", "Connected to redis://127.0.0.1:6379/1"),
    ],
)
def test_redact_text(raw: str, expected: str) -> None:
    assert redact_text(raw) == expected


def test_job_context_binds_fields_and_close_unbinds_once(restore_logging: None) -> None:
    outer = JobContext(NO_PLATFORM, job_id="outer", attempt=1, stage="s.outer", flow_id=None, queue="q1")
    inner = JobContext(NO_PLATFORM, job_id="inline", attempt=1, stage="s.inner", flow_id=None)
    assert structlog.contextvars.get_contextvars()["job_id"] == "inline"
    inner.close()
    inner.close()  # idempotent: must not undo the outer job's binding
    assert structlog.contextvars.get_contextvars() == {
        "job_id": "outer",
        "stage": "s.outer",
        "attempt": 1,
        "queue": "q1",
    }
    outer.close()
    assert structlog.contextvars.get_contextvars() == {}
    with job_context("j", "s", 3, "q"):
        assert structlog.contextvars.get_contextvars()["attempt"] == 3
    assert structlog.contextvars.get_contextvars() == {}


def test_ctx_log_carries_job_fields_in_json(restore_logging: None) -> None:
    buf = capture("json")
    ctx = JobContext(NO_PLATFORM, job_id="j-7", attempt=2, stage="s", flow_id=None, queue="files")
    ctx.log.info("copied %s rows", 12, password="hunter2")
    ctx.log.warning("plain")
    ctx.close()
    ctx.log.info("after close")  # still bound on the logger itself
    lines = json_lines(buf)
    assert [line["event"] for line in lines] == ["copied 12 rows", "plain", "after close"]
    for line in lines:
        assert (line["job_id"], line["stage"], line["attempt"], line["queue"]) == ("j-7", "s", 2, "files")
        assert line["logger"] == "conveyor.job"
    assert lines[0]["password"] == "***"


def test_ctx_log_goes_through_stdlib_when_not_configured(
    restore_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    structlog.reset_defaults()
    ctx = JobContext(NO_PLATFORM, job_id="j-8", attempt=1, stage="s", flow_id=None)
    with caplog.at_level(logging.INFO, logger="conveyor.job"):
        ctx.log.info("hello %s", "world", token="abc")
    ctx.close()
    [record] = [r for r in caplog.records if r.name == "conveyor.job"]
    message = record.getMessage()
    assert message.startswith("hello world [") and "job_id=j-8" in message
    assert "token=***" in message and "abc" not in message


def test_celery_setup_logging_signal_uses_conveyor_logging(restore_logging: None) -> None:
    class FakePlatform:
        settings = ConveyorSettings(log_format="json")

    disconnect = use_conveyor_logging(FakePlatform())  # type: ignore[arg-type]
    try:
        buf = io.StringIO()
        signals.setup_logging.send(sender=None, loglevel=logging.INFO, logfile=buf, format="", colorize=False)
    finally:
        disconnect()
    logging.getLogger("celery.worker.consumer").info("%s ready.", "celery@node")
    logging.getLogger("multiprocessing").error("Process %r pid:%r exited with %r", "W-1", 7, "signal 9")
    logging.getLogger("multiprocessing").warning("below billiard's level")
    events = [line["event"] for line in json_lines(buf)]
    assert events == ["celery@node ready.", "Process 'W-1' pid:7 exited with 'signal 9'"]


TRACE_HEX, SPAN_HEX = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def _a_span() -> Any:
    """A current span with known ids, through the OpenTelemetry API alone (no SDK)."""
    from opentelemetry import trace

    context = trace.SpanContext(
        trace_id=int(TRACE_HEX, 16),
        span_id=int(SPAN_HEX, 16),
        is_remote=False,
        trace_flags=trace.TraceFlags(1),
    )
    return trace.use_span(trace.NonRecordingSpan(context))


def test_lines_logged_inside_a_span_carry_its_trace_and_span_ids(restore_logging: None) -> None:
    buf = capture("json")
    with _a_span():
        logging.getLogger("conveyor.x").warning("stdlib inside")
        structlog.get_logger("conveyor.y").warning("structlog inside")
    logging.getLogger("conveyor.x").warning("outside")
    lines = json_lines(buf)
    assert [line.get("trace_id") for line in lines] == [TRACE_HEX, TRACE_HEX, None]
    assert [line.get("span_id") for line in lines] == [SPAN_HEX, SPAN_HEX, None]


def test_ctx_log_through_stdlib_carries_the_trace_ids_too(
    restore_logging: None, caplog: pytest.LogCaptureFixture
) -> None:
    structlog.reset_defaults()
    ctx = JobContext(NO_PLATFORM, job_id="j-9", attempt=1, stage="s", flow_id=None)
    with caplog.at_level(logging.INFO, logger="conveyor.job"), _a_span():
        ctx.log.info("traced")
    ctx.close()
    [record] = [r for r in caplog.records if r.name == "conveyor.job"]
    assert f"trace_id={TRACE_HEX}" in record.getMessage() and f"span_id={SPAN_HEX}" in record.getMessage()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("celery worker --password S3CR3T -l INFO", "celery worker --password *** -l INFO"),
        ("run -token S3CR3T", "run -token ***"),
        ("run --db-password 'S3 CR3T' --verbose", "run --db-password '***' --verbose"),
        ("run --api-key=S3CR3T", "run --api-key=***"),
        ("run --password --verbose", "run --password --verbose"),  # no value: the next option
        ("['conveyor', 'login', '--password', 'S3CR3T']", "['conveyor', 'login', '--password', '***']"),
        ("('password', 'S3CR3T')", "('password', '***')"),
        ('["api_key", "S3CR3T", "n", 1]', '["api_key", "***", "n", 1]'),
        ("['token', 12345]", "['token', ***]"),
        ("the password was reset", "the password was reset"),  # prose is not an option
    ],
)
def test_redact_text_masks_options_and_listed_pairs(raw: str, expected: str) -> None:
    assert redact_text(raw) == expected


def test_redact_value_masks_the_item_after_a_secret_name_in_a_sequence() -> None:
    assert redact_value(["password", "S3CR3T"]) == ["password", "***"]
    assert redact_value(("prog", "--token", "S3CR3T", "-v")) == ("prog", "--token", "***", "-v")
    assert redact_value({"argv": ["x", "--api-key", "S3CR3T"]}) == {"argv": ["x", "--api-key", "***"]}
    assert redact_value(["--password", "--verbose", "on"]) == ["--password", "--verbose", "on"]
    assert redact_value(["password"]) == ["password"]  # nothing after it
    assert redact_value(["password", None]) == ["password", None]
    assert redact_value(["a password is needed", "ok"]) == ["a password is needed", "ok"]


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_argv_secrets_never_reach_the_rendered_output(restore_logging: None, log_format: str) -> None:
    buf = capture(log_format)
    logging.getLogger("conveyor.x").warning("started: celery worker --password S3CR3T -l INFO")
    logging.getLogger("conveyor.x").warning("argv %s", ["conveyor", "--password", "S3CR3T"])
    structlog.get_logger("conveyor.y").warning("argv", argv=["password", "S3CR3T"], n=1)
    out = buf.getvalue()
    assert "S3CR3T" not in out
    assert out.count("***") == 3 and "--password" in out


def test_logging_set_up_on_first_record_renders_that_record_once(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logging.getLogger().handlers[:] = []
    structlog.reset_defaults()
    configure_logging_on_first_record(ConveyorSettings(log_format="json", log_level="INFO"))
    assert not structlog.is_configured()
    logging.getLogger("conveyor.x").debug("below the level")
    assert not structlog.is_configured()
    logging.getLogger("conveyor.x").info("first token=%s", "s3cret")
    logging.getLogger("conveyor.x").info("second")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["first token=***", "second"]
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1


def test_logging_set_up_meanwhile_is_left_alone(restore_logging: None) -> None:
    logging.getLogger().handlers[:] = []
    configure_logging_on_first_record(ConveyorSettings(log_format="console"))
    buf = capture("json")  # as Celery's setup_logging does in a worker, into its log file
    logging.getLogger("conveyor.x").warning("into the file")
    assert [line["event"] for line in json_lines(buf)] == ["into the file"]
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1
