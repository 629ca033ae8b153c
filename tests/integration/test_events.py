"""The outbox's positions are commit-ordered: a reader never skips an event whose
transaction started first but committed last, and is not held back by it either."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from conveyor.store.db.schema import job_events
from conveyor.store.jobs import new_event

pytestmark = pytest.mark.timeout(60)


def test_lower_position_committing_last_is_not_skipped(platform: Any, tag: str) -> None:
    store = platform.store
    with platform.engine.connect() as conn:
        start_cursor = _tail_cursor(platform)
        slow = platform.engine.connect()
        slow_tx = slow.begin()
        store.emit(slow, [new_event(None, "test.first", {"tag": tag})])  # lower id, commits last
        with platform.engine.begin() as fast:
            store.emit(fast, [new_event(None, "test.second", {"tag": tag})])
        seen_early, cursor = _mine(platform, start_cursor, tag)
        assert [e["topic"] for e in seen_early] == ["test.second"]  # not held back by the open one
        slow_tx.commit()
        slow.close()
        seen, _ = _mine(platform, cursor, tag)
        assert [e["topic"] for e in seen] == ["test.first"]  # after the cursor, not skipped
        assert seen[0]["id"] < seen_early[0]["id"] and seen[0]["position"] > seen_early[0]["position"]
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


def test_committed_events_are_numbered_in_commit_order(platform: Any, tag: str) -> None:
    start_cursor = _tail_cursor(platform)
    with platform.engine.begin() as conn:
        platform.store.emit(conn, [new_event(None, "test.numbered", {"tag": tag, "i": i}) for i in range(3)])
    seen, _ = _mine(platform, start_cursor, tag)
    assert [e["body"]["i"] for e in seen] == [0, 1, 2]
    with platform.engine.connect() as conn:
        rows = conn.execute(select(job_events).where(job_events.c.id.in_([e["id"] for e in seen]))).mappings()
        seqs = {r["id"]: r["seq"] for r in rows}
    assert [seqs[e["id"]] for e in seen] == [e["position"] for e in seen]
    assert [e["position"] for e in seen] == sorted(e["position"] for e in seen)
