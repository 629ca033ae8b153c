"""Chunk staging (SQLite's way of writing a big document's chunks in short transactions):
staged chunks are invisible to search until adopted, adoption is a key change that keeps
the full-text index whole, and draining deletes a few at a time."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text, update

from pipelines.files import search
from tasks.files import flow
from tasks.files.chunking import Chunk
from tasks.files.models import CHUNKING, READY, chunks, files

pytestmark = pytest.mark.timeout(120)


def _file(platform: Any, owner: str, status: str) -> str:
    file_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    with platform.engine.begin() as conn:
        conn.execute(
            insert(files).values(
                id=file_id, owner=owner, name="f.txt", size=1, content_ref="-", checksum="-",
                status=status, created_at=now, updated_at=now,
            )
        )  # fmt: skip
    return file_id


def _file_with_chunks(platform: Any, owner: str, status: str, texts: list[str]) -> str:
    file_id = _file(platform, owner, status)
    with platform.engine.begin() as conn:
        flow.replace_chunks(conn, file_id, owner, _pieces(*texts))
    return file_id


def _pieces(*texts: str) -> list[Chunk]:
    return [Chunk(i, t, 0, len(t), 1) for i, t in enumerate(texts)]


def _count(platform: Any, file_id: str) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(chunks.c.file_id == file_id)).scalar_one())


def _fts_whole(platform: Any) -> None:
    if platform.engine.dialect.name == "sqlite":
        with platform.engine.begin() as conn:
            fts = conn.execute(
                text("SELECT name FROM sqlite_master WHERE name LIKE '%file_chunks_fts'")
            ).scalar()
            conn.execute(text(f"INSERT INTO {fts}({fts}, rank) VALUES ('integrity-check', 1)"))


def test_staged_chunks_are_found_only_once_adopted(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flow, "STAGE_BYTES", 20)  # a transaction per chunk or two
    file_id = _file(db, tag, CHUNKING)
    key = flow.staging_key("test", file_id)
    texts = [f"lighthouse keeper number {i} of the volcano" for i in range(7)]
    seen: list[int] = []
    flow.stage_chunks(
        db.engine.begin, key, tag, _pieces(*texts), between=lambda: seen.append(_count(db, key))
    )
    assert seen == sorted(seen) and seen[-1] == 7 and len(seen) > 3  # written in several transactions
    with db.engine.begin() as conn:
        conn.execute(update(files).where(files.c.id == file_id).values(status=READY))
    assert search(db, "lighthouse volcano", owner=tag, ranking="lexical") == []  # staged: no file has the key
    with db.engine.begin() as conn:
        flow.adopt_chunks(conn, key, file_id)
    assert (_count(db, key), _count(db, file_id)) == (0, 7)
    assert [h.file_id for h in search(db, "lighthouse volcano", owner=tag, ranking="lexical")] == [file_id]
    _fts_whole(db)


def test_retired_chunks_leave_search_and_drain_a_few_at_a_time(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flow, "DELETE_ROWS", 3)
    file_id = _file_with_chunks(db, tag, READY, [f"sourdough starter {i}" for i in range(10)])
    staged = flow.staging_key("test", file_id)
    flow.stage_chunks(db.engine.begin, staged, tag, _pieces("basalt caldera"))
    with db.engine.begin() as conn:
        retired = flow.retire_chunks(conn, file_id)
        flow.adopt_chunks(conn, staged, file_id)
    assert [h.file_id for h in search(db, "basalt", owner=tag, ranking="lexical")] == [file_id]
    assert search(db, "sourdough", owner=tag, ranking="lexical") == []
    assert _count(db, retired) == 10
    flow.drain_chunks(db.engine.begin, retired)
    assert _count(db, retired) == 0
    _fts_whole(db)


def test_draining_a_files_chunks_stops_once_the_file_moves(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flow, "DELETE_ROWS", 2)
    file_id = _file_with_chunks(db, tag, CHUNKING, [f"orchid {i}" for i in range(9)])
    begun = 0

    def begin() -> Any:
        nonlocal begun
        begun += 1
        if begun == 3:  # another writer moved the file on meanwhile
            with db.engine.begin() as conn:
                conn.execute(update(files).where(files.c.id == file_id).values(status=READY))
        return db.engine.begin()

    flow.drain_chunks(begin, file_id, while_status=CHUNKING)
    assert _count(db, file_id) == 5  # two transactions of two, then it stopped
