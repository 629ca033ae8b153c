"""The files pipeline: pure canvas builders, and the functions apps call.

``upload`` stores content by reference; ``confirm`` moves one file ``uploaded → queued``
and submits its chain in the same transaction (published only after commit, so a
confirmed file can never be left behind, and confirming twice launches one flow);
``process_batch`` does the same for every file of a sealed batch with one chord whose
body only asks Postgres whether the batch is complete.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Signature, chain, chord, group
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from conveyor.db.dialect import db_now
from conveyor.db.schema import dead_letters, jobs
from conveyor.platform import Platform
from conveyor.store import new_event
from tasks.files import flow
from tasks.files.models import CANCELLED, FAILED, QUEUED, TERMINAL, UPLOADED, batches, chunks, files


def file_chain(file_id: str, name: str | None = None) -> Signature:
    """extract → chunk → embed for one file (each later stage gets the previous result)."""
    from tasks.files.stages import chunk_stage, embed_stage, extract_stage

    return chain(extract_stage.si(file_id=file_id, name=name), chunk_stage.s(), embed_stage.s())


def batch_chord(batch_id: str, named: Sequence[tuple[str, str]]) -> Signature:
    """Every file's chain as a chord header; the body asks Postgres to complete the batch."""
    from tasks.files.stages import complete_batch

    return chord(group(file_chain(f, n) for f, n in named), complete_batch.s(batch_id=batch_id))


@dataclass(frozen=True)
class Upload:
    """A file to upload: its name and bytes."""

    name: str
    data: bytes


def _storage_put(platform: Platform, key: str, data: bytes) -> str:
    from tasks.files.stages import _settings
    from tasks.files.storage import LocalStorage, S3Storage

    settings = _settings()
    if settings.files.s3 is not None:
        return S3Storage.from_settings(settings.files.s3).put(key, data)
    return LocalStorage(settings.files_storage_dir()).put(key, data)


def _safe_segment(text: str, fallback: str) -> str:
    """A storage key segment: no separators, no dot-only names."""
    cleaned = re.sub(r"[^\w.\-]+", "_", text).strip("._")
    return cleaned or fallback


def _storage_key(owner: str, file_id: str, name: str) -> str:
    """Where a file's content lives: ``<owner>/<file id>/<file name>``."""
    return f"{_safe_segment(owner, 'owner')}/{file_id}/{_safe_segment(Path(name).name, 'file')}"


def new_batch(platform: Platform, owner: str) -> str:
    """An open (unsealed) batch."""
    batch_id = str(uuid.uuid4())
    with platform.engine.begin() as conn:
        conn.execute(
            insert(batches).values(
                id=batch_id,
                owner=owner,
                sealed=False,
                total=0,
                terminal=0,
                ready=0,
                failed=0,
                cancelled=0,
                status="open",
                created_at=db_now(),
            )
        )
    return batch_id


def upload(platform: Platform, owner: str, item: Upload, *, batch_id: str | None = None) -> str:
    """Store the content and record the file ``uploaded``; returns the file id."""
    file_id = str(uuid.uuid4())
    ref = _storage_put(platform, _storage_key(owner, file_id, item.name), item.data)
    with platform.engine.begin() as conn:
        conn.execute(
            insert(files).values(
                id=file_id,
                owner=owner,
                batch_id=batch_id,
                name=Path(item.name).name[:500],
                size=len(item.data),
                content_ref=ref,
                checksum=hashlib.sha256(item.data).hexdigest(),
                status=UPLOADED,
                created_at=db_now(),
                updated_at=db_now(),
            )
        )
    return file_id


def _emit(platform: Platform, session: Session) -> flow.Emit:
    return lambda topic, body: platform.store.emit(session.connection(), [new_event(None, topic, dict(body))])


def confirm(platform: Platform, file_id: str) -> bool:
    """``uploaded → queued`` and submit its chain, in one transaction. False if already confirmed."""
    with Session(platform.engine) as session:
        if (
            flow.transition(session.connection(), file_id, [UPLOADED], QUEUED, _emit(platform, session))
            is None
        ):
            return False
        with platform.enlisted(session):
            file_chain(file_id).apply_async()
        session.commit()
    return True


def process_batch(platform: Platform, owner: str, items: Sequence[Upload]) -> str:
    """Upload every file, seal the batch, queue the files and apply one chord, atomically."""
    batch_id = new_batch(platform, owner)
    file_ids = [upload(platform, owner, item, batch_id=batch_id) for item in items]
    with Session(platform.engine) as session:
        conn = session.connection()
        conn.execute(
            batches.update()
            .where(batches.c.id == batch_id)
            .values(sealed=True, total=len(file_ids), status="processing")
        )
        for f in file_ids:
            flow.transition(conn, f, [UPLOADED], QUEUED, _emit(platform, session))
        flow.try_complete(conn, batch_id, _emit(platform, session))  # an empty batch completes at once
        if file_ids:
            with platform.enlisted(session):
                named = [(f, Path(item.name).name) for f, item in zip(file_ids, items, strict=True)]
                batch_chord(batch_id, named).apply_async()
        session.commit()
    return batch_id


def cancel_batch(platform: Platform, batch_id: str, *, by: str = "api") -> int:
    """Cancel the batch's non-terminal files (cancelled counts as terminal); returns how many."""
    with platform.engine.connect() as conn:
        open_files = (
            conn.execute(
                select(files.c.id).where(files.c.batch_id == batch_id, files.c.status.not_in(list(TERMINAL)))
            )
            .scalars()
            .all()
        )
    n = 0
    for f in open_files:
        with Session(platform.engine) as session:
            before = flow.transition(
                session.connection(),
                f,
                ["uploaded", "queued", "extracting", "chunking", "embedding"],
                CANCELLED,
                _emit(platform, session),
                error=f"cancelled by {by}",
            )
            session.commit()
        n += before is not None
    return n


def replace_content(platform: Platform, file_id: str, data: bytes) -> None:
    """Fix a file's content in place (same reference), e.g. before retrying it from the DLQ."""
    with platform.engine.begin() as conn:
        row = flow.get_file(conn, file_id)
        if row is None:
            raise LookupError(f"file {file_id} not found")
        key = _storage_key(row["owner"], file_id, row["name"])
        if _storage_put(platform, key, data) != row["content_ref"]:
            raise ValueError(f"file {file_id} is stored elsewhere; upload it again instead")
        conn.execute(
            files.update()
            .where(files.c.id == file_id)
            .values(size=len(data), checksum=hashlib.sha256(data).hexdigest(), updated_at=db_now())
        )


def retry_failed(platform: Platform, batch_id: str, *, by: str = "api") -> list[str]:
    """Retry the batch's failed files from the DLQ, each from the stage it failed in.

    Returns the retried job ids. The batch stays completed if it was; its new totals come
    as ``batch.summary_changed``.
    """
    with platform.engine.connect() as conn:
        failed = set(
            conn.execute(select(files.c.id).where(files.c.batch_id == batch_id, files.c.status == FAILED))
            .scalars()
            .all()
        )
        entries = conn.execute(
            select(dead_letters.c.id, jobs.c.payload)
            .join(jobs, jobs.c.id == dead_letters.c.job_id)
            .where(dead_letters.c.retried_at.is_(None), dead_letters.c.stage.like("conveyor.files.%"))
        ).all()
    retried = []
    for entry_id, payload in entries:
        if (payload or {}).get("file_id") in failed:
            job_id = platform.dlq.retry(int(entry_id), by=by)
            if job_id is not None:
                retried.append(job_id)
    return retried


@dataclass(frozen=True)
class Hit:
    """One search result."""

    file_id: str
    name: str
    ordinal: int
    score: float
    text: str


def search(platform: Platform, query: str, *, owner: str, limit: int = 5) -> list[Hit]:
    """The best chunks for ``query`` among ``owner``'s files (never another user's)."""
    from tasks.files.embedding import cosine, unpack
    from tasks.files.stages import _embedder, _settings

    vector = _embedder(_settings().files.embedder).embed([query])[0]
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(chunks.c.file_id, chunks.c.ordinal, chunks.c.text, chunks.c.embedding, files.c.name)
            .join(files, files.c.id == chunks.c.file_id)
            .where(chunks.c.owner == owner, files.c.owner == owner, chunks.c.embedding.is_not(None))
        ).all()
    scored = [Hit(r.file_id, r.name, r.ordinal, cosine(vector, unpack(r.embedding)), r.text) for r in rows]
    scored.sort(key=lambda h: h.score, reverse=True)
    best: dict[str, Hit] = {}
    for hit in scored:  # one hit per file, best chunk first
        best.setdefault(hit.file_id, hit)
    return list(best.values())[:limit]


def batch_status(platform: Platform, batch_id: str) -> dict[str, Any]:
    """The batch's counters and its files' states."""
    with platform.engine.connect() as conn:
        summary = flow.batch_summary(conn, batch_id)
        states = conn.execute(
            select(files.c.name, files.c.status, files.c.error).where(files.c.batch_id == batch_id)
        ).all()
    if summary is None:
        raise LookupError(f"batch {batch_id} not found")
    return {"batch": dict(summary), "files": [dict(r._mapping) for r in states]}
