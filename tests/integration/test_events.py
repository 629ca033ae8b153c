"""The outbox's positions are commit-ordered: a reader never skips an event whose
transaction started first but committed last."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from conveyor.db.schema import job_events
from conveyor.store import new_event

pytestmark = pytest.mark.timeout(60)


def test_lower_position_committing_last_is_not_skipped(platform: Any, tag: str) -> None:
    store = platform.store
    with platform.engine.connect() as conn:
        start_cursor = _tail_cursor(platform)
        slow = platform.engine.connect()
        slow_tx = slow.begin()
        store.emit(slow, [new_event(None, "test.first", {"tag": tag})])  # lower id and txid
        with platform.engine.begin() as fast:
            store.emit(fast, [new_event(None, "test.second", {"tag": tag})])
        seen_early, cursor = _mine(platform, start_cursor, tag)
        assert [e["topic"] for e in seen_early] == []  # second is held back, not skipped past
        slow_tx.commit()
        slow.close()
        seen, _ = _mine(platform, cursor, tag)
        assert [e["topic"] for e in seen] == ["test.first", "test.second"]
        ids = [e["id"] for e in seen]
        assert ids == sorted(ids)
        del conn


def _tail_cursor(platform: Any) -> str | None:
    cursor = None
    with platform.engine.connect() as conn:
        while True:
            rows, nxt = platform.store.events_since(conn, cursor, limit=5000)
            if not rows:
                return cursor
            cursor = nxt


def _mine(platform: Any, cursor: str | None, tag: str) -> tuple[list[Any], str | None]:
    out = []
    with platform.engine.connect() as conn:
        while True:
            rows, nxt = platform.store.events_since(conn, cursor, limit=5000)
            if not rows:
                return out, cursor
            out += [r for r in rows if r["body"].get("tag") == tag]
            cursor = nxt


def test_event_rows_carry_writer_txid(platform: Any) -> None:
    with platform.engine.connect() as conn:
        row = conn.execute(select(job_events).order_by(job_events.c.id.desc()).limit(1)).mappings().first()
    assert row is None or row["txid"] > 0
