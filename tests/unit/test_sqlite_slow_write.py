"""The 2 s bound on SQLite's write lock is measured by every process that holds it: a write
transaction held longer is logged (tests/fault/test_files_sqlite.py asserts no stage, relay,
heartbeat or CLI transaction ever is). This proves the measurement is not vacuous: a held
transaction over the bound is reported, and one under it is not."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from conveyor.store.db.dialect import SLOW_WRITE
from conveyor.store.db.engine import make_engine

MESSAGE = "SQLite write lock held for"


def _write(path: Path, hold: float) -> None:
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
            time.sleep(hold)
    finally:
        engine.dispose()


def test_a_write_held_past_the_bound_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert SLOW_WRITE == 2.0
    with caplog.at_level(logging.WARNING, logger="conveyor.db"):
        _write(tmp_path / "slow.db", SLOW_WRITE + 0.3)
    assert [r for r in caplog.records if MESSAGE in r.getMessage()], caplog.text


def test_a_short_write_is_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.db"):
        _write(tmp_path / "quick.db", 0.0)
    assert MESSAGE not in caplog.text
