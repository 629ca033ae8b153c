"""Chunk staging (SQLite's way of writing a big document's chunks in short transactions):
staged chunks are invisible to search until adopted, adoption is a key change that keeps
the full-text index whole, and draining deletes a few at a time."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text, update

from conveyor.runfile import owner_id
from conveyor.store.db.schema import SUCCEEDED, jobs
from conveyor.store.jobs import ClaimOutcome, NewJob
from pipelines.files import search
from tasks.files import flow
from tasks.files.chunking import Chunk
from tasks.files.models import CHUNKING, READY, batches, chunks, files, staging

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


def _attempt(platform: Any, job_id: str | None, owner: str) -> tuple[str, int]:
    """Claim ``job_id`` (a new job when None) for ``owner``: its running attempt."""
    with platform.engine.begin() as conn:
        if job_id is None:
            new = NewJob(stage="conveyor.files.chunk", queue="files", payload={}, max_attempts=3)
            job_id, _ = platform.store.insert(conn, new)
        claim = platform.store.claim(conn, job_id, owner=owner, task_id=str(uuid.uuid4()))
    assert claim.outcome is ClaimOutcome.RUN
    return job_id, int(claim.job["attempts"])


def _staged(platform: Any, file_id: str, job_id: str, attempt: int, n: int) -> str:
    key = flow.staging_key(job_id, attempt)
    with platform.engine.begin() as conn:
        flow.claim_staging(conn, key, file_id, job_id, attempt)
    flow.stage_chunks(platform.engine.begin, key, "someone", _pieces(*[f"pumice {i}" for i in range(n)]))
    return key


def test_the_sweep_drains_what_dead_attempts_staged_and_spares_the_live_one(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flow, "DELETE_ROWS", 2)
    file_id = _file(db, tag, CHUNKING)
    gone = subprocess.Popen(["true"])
    gone.wait()
    job_id, first = _attempt(db, None, owner_id(gone.pid))  # its worker is dead...
    taken = _staged(db, file_id, job_id, first, 5)
    job_id, second = _attempt(db, job_id, owner_id())  # ...so it was taken over
    live = _staged(db, file_id, job_id, second, 3)
    purged = _staged(db, file_id, str(uuid.uuid4()), 1, 4)  # its job is gone (retention)

    assert flow.sweep_staging(db.engine, stale_after=3600) >= 2  # (the database may be shared)
    assert (_count(db, taken), _count(db, purged), _count(db, live)) == (0, 0, 3)
    with db.engine.connect() as conn:
        assert conn.execute(select(staging.c.key).where(staging.c.file_id == file_id)).scalars().all() == [
            live
        ]
    flow.sweep_staging(db.engine, stale_after=3600)
    assert _count(db, live) == 3  # the live attempt keeps what it staged

    with db.engine.begin() as conn:  # it ends (here: failed) without adopting them
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(status="failed"))
    assert flow.sweep_staging(db.engine, stale_after=3600) >= 1
    assert _count(db, live) == 0
    _fts_whole(db)


def test_adopting_forgets_the_staging_key(db: Any, tag: str) -> None:
    file_id = _file(db, tag, CHUNKING)
    job_id, attempt = _attempt(db, None, owner_id())
    key = _staged(db, file_id, job_id, attempt, 3)
    with db.engine.begin() as conn:
        flow.adopt_chunks(conn, key, file_id)
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(status="succeeded"))
    flow.sweep_staging(db.engine, stale_after=3600)
    assert _count(db, file_id) == 3
    with db.engine.connect() as conn:
        assert conn.execute(select(staging.c.key).where(staging.c.key == key)).first() is None


def test_a_key_no_job_owns_is_swept_once_stale(db: Any, tag: str) -> None:
    """A re-embed (in a caller's process, no job) records its keys without an owner: a
    sweep leaves them while they may still be in use, and drains them once stale."""
    file_id = _file_with_chunks(db, tag, READY, [f"sourdough starter {i}" for i in range(4)])
    staged = flow.staging_key("test", file_id)
    with db.engine.begin() as conn:
        flow.claim_staging(conn, staged, file_id)
    flow.stage_chunks(db.engine.begin, staged, tag, _pieces("basalt caldera", "pumice"))
    with db.engine.begin() as conn:
        retired = flow.retire_chunks(conn, file_id)  # the swap, then killed before the drain
        flow.adopt_chunks(conn, staged, file_id)
    assert (_count(db, file_id), _count(db, retired)) == (2, 4)
    flow.sweep_staging(db.engine, stale_after=3600)
    assert _count(db, retired) == 4  # maybe still in use: left alone
    flow.sweep_staging(db.engine, stale_after=0)
    assert (_count(db, file_id), _count(db, retired)) == (2, 0)
    with db.engine.connect() as conn:
        assert conn.execute(select(staging.c.key).where(staging.c.file_id == file_id)).first() is None
    _fts_whole(db)


def test_the_files_reconciler_completes_and_sweeps_in_one_pass_on_sqlite(
    on_sqlite: Any, worker: Any, tag: str
) -> None:
    """The periodic ``conveyor.files.reconcile`` job on SQLite, with a batch to complete (a
    lost chord counter) and a dead staging key to sweep: its own transaction holds the one
    writer once it completes a batch, so its sweeps, in transactions of their own, must
    not come after that (they waited for the writer forever)."""
    db = on_sqlite
    now = datetime.now(UTC)
    batch_id = str(uuid.uuid4())
    with db.engine.begin() as conn:
        conn.execute(
            insert(batches).values(
                id=batch_id, owner=tag, sealed=True, total=0, terminal=0, ready=0, failed=0, cancelled=0,
                status="processing", created_at=now,
            )
        )  # fmt: skip
    file_id = _file(db, tag, CHUNKING)
    dead = _staged(db, file_id, str(uuid.uuid4()), 1, 3)  # its job is gone
    job = db.submit("conveyor.files.reconcile", {})
    assert job.wait(30) == SUCCEEDED
    with db.engine.connect() as conn:
        assert (
            conn.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar_one() == "completed"
        )
    assert _count(db, dead) == 0
