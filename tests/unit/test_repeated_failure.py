"""A background loop's failures are logged without flooding (the relay during an outage)."""

from __future__ import annotations

import logging

import pytest

from conveyor.logs import RepeatedFailure


def test_the_same_failure_is_logged_once_then_counted_then_its_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("conveyor.test.repeated")
    notes = RepeatedFailure(log, "relay pass", every=60)
    with caplog.at_level(logging.WARNING, logger=log.name):
        down = ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        for second in range(0, 150, 2):  # a pass every 2 s for 150 s
            notes.failed(down, float(second))
        notes.passed()
        notes.passed()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "relay pass failed" and caplog.records[0].exc_info is not None
    refused = "ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused."
    assert lines[1:3] == [
        f"relay pass still failing (31 times so far): {refused}",
        f"relay pass still failing (61 times so far): {refused}",
    ]
    assert lines[3:] == ["relay pass works again after 75 failures"]
    assert all(r.exc_info is None for r in caplog.records[1:])


def test_a_different_failure_is_logged_in_full_at_once(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("conveyor.test.repeated2")
    notes = RepeatedFailure(log, "relay pass")
    with caplog.at_level(logging.WARNING, logger=log.name):
        notes.failed(ConnectionError("redis down"), 0.0)
        notes.failed(TimeoutError("database busy"), 1.0)
    assert [r.exc_info is not None for r in caplog.records] == [True, True]
