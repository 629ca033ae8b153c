"""Messages no stage can run land in the DLQ with their headers, never their body, and the
worker stays up."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(120)

SECRET = "alice@example.com-secret-canary"


def _raw_publish(platform: Any, *, task: str, body: bytes, content_type: str, queue: str = "demo") -> str:
    task_id = str(uuid.uuid4())
    with platform.app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            body,
            exchange="conveyor",
            routing_key=queue,
            content_type=content_type,
            content_encoding="utf-8" if content_type == "application/json" else "binary",
            headers={
                "lang": "py",
                "task": task,
                "id": task_id,
                "root_id": task_id,
                "parent_id": None,
                "group": None,
            },
        )
    return task_id


def _letter(platform: Any, task_id: str) -> Any:
    with platform.engine.connect() as conn:
        for row in conn.execute(select(dead_letters).where(dead_letters.c.job_id.is_(None))).mappings():
            if (row["headers"] or {}).get("id") == task_id:
                return row
    return None


def _assert_worker_alive(platform: Any) -> None:
    handle = platform.submit("conveyor.demo.square", {"n": 3})
    assert handle.wait(30) == s.SUCCEEDED


@pytest.mark.parametrize(
    ("kind", "task", "body", "content_type", "error_type"),
    [
        (
            "unknown task",
            "conveyor.nope.missing",
            json.dumps([[], {"email": SECRET}, {}]).encode(),
            "application/json",
            "UnknownTask",
        ),
        (
            "pickle",
            "conveyor.demo.square",
            b"\x80\x04\x95" + SECRET.encode(),
            "application/x-python-serialize",
            "ContentDisallowed",
        ),
        ("undecodable", "conveyor.demo.square", b"{not json " + SECRET.encode(), "application/json", None),
    ],
)
def test_garbage_goes_to_dlq_without_body(
    platform: Any,
    worker: Any,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    task: str,
    body: bytes,
    content_type: str,
    error_type: str | None,
) -> None:
    caplog.set_level(logging.DEBUG)
    task_id = _raw_publish(platform, task=task, body=body, content_type=content_type)
    letter = eventually(lambda: _letter(platform, task_id))
    if error_type:
        assert letter["error_type"] == error_type
    assert letter["headers"]["task"] == task
    assert SECRET not in json.dumps(dict(letter), default=str)
    assert SECRET not in caplog.text
    _assert_worker_alive(platform)
