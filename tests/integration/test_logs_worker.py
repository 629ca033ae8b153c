"""Log lines emitted while a real worker runs a job carry that job's fields (JSON mode)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from conveyor.logs import configure_logging
from conveyor.settings import ConveyorSettings
from conveyor.store.db import schema as s
from conveyor.worker.context import JobContext

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """Conveyor's JSON logging into a buffer; the logging setup is restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configured, config = structlog.is_configured(), structlog.get_config()
    buf = io.StringIO()
    configure_logging(ConveyorSettings(log_format="json", log_level="INFO"), stream=buf)
    yield buf
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


def test_lines_logged_during_a_job_carry_its_fields(
    platform: Any, worker: Any, json_logs: io.StringIO, monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    task = platform.app.tasks["conveyor.demo.square"]
    body = task.spec.fn

    def logging_body(ctx: JobContext, payload: Any) -> Any:
        ctx.log.info("stage line %s", tag, password="hunter2")
        logging.getLogger("conveyor.test").warning("library line %s via redis://:s3cret@h:1", tag)
        return body(ctx, payload)

    monkeypatch.setattr(task, "spec", dataclasses.replace(task.spec, fn=logging_body))
    handle = platform.submit("conveyor.demo.square", {"n": 3})
    assert handle.wait(timeout=30) == s.SUCCEEDED

    text = json_logs.getvalue()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    # This job's lines: a square job of an earlier test falling due meanwhile runs this body too.
    ours = [line for line in lines if tag in line["event"] and line.get("job_id") == handle.id]
    assert [line["logger"] for line in ours] == ["conveyor.job", "conveyor.test"]
    for line in ours:
        assert line["job_id"] == handle.id
        assert (line["stage"], line["attempt"], line["queue"]) == ("conveyor.demo.square", 1, "demo")
    assert ours[0]["password"] == "***"
    assert "hunter2" not in text and "s3cret" not in text
