"""The file state machine and batch accounting, as SQL on the caller's connection.

Every transition is a compare-and-set on the file's status. A file's terminal transition
(ready, failed, cancelled) increments its batch's counters in the same transaction, and
the transaction that makes ``sealed AND terminal = total`` flips the batch to
``completed`` by compare-and-set: ``batch.completed`` is written exactly once, whatever
the chord does. The chord callback and the reconciler only call :func:`try_complete`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, delete, func, insert, or_, select, update
from sqlalchemy.engine import RowMapping

from conveyor.store.db.dialect import db_now, db_now_plus
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import RUNNING, jobs
from tasks.files.chunking import Chunk
from tasks.files.embedding import pack_ids
from tasks.files.models import (
    CANCELLED,
    CHUNKING,
    EMBEDDING,
    EXTRACTING,
    FAILED,
    QUEUED,
    READY,
    TERMINAL,
    UPLOADED,
    batches,
    chunks,
    file_vectors,
    files,
    staging,
)

PROGRESS_STATES = (UPLOADED, QUEUED, EXTRACTING, CHUNKING, EMBEDDING, READY, FAILED, CANCELLED)


class BatchClosed(Exception):
    """The batch takes no more files: sealed, or it has its expected count."""


Emit = Callable[[str, Mapping[str, Any]], None]


def get_file(conn: Connection, file_id: str) -> RowMapping | None:
    """One file row."""
    return conn.execute(select(files).where(files.c.id == file_id)).mappings().one_or_none()


def transition(
    conn: Connection, file_id: str, from_status: Iterable[str], to: str, emit: Emit, **values: Any
) -> RowMapping | None:
    """CAS ``from_status → to`` (plus ``values``); emits ``file.status_changed``.

    Returns the file as it was before, or None when the file was not in ``from_status``.
    A terminal ``to`` counts the file in its batch, in this same transaction.
    """
    before = (
        conn.execute(
            select(files)
            .where(files.c.id == file_id, files.c.status.in_(list(from_status)))
            .with_for_update()
        )
        .mappings()
        .one_or_none()
    )
    if before is None:
        return None
    res = conn.execute(
        update(files)
        .where(files.c.id == file_id, files.c.status == before["status"])
        .values(status=to, updated_at=db_now(), **values)
    )
    if res.rowcount != 1:
        return None
    emit(
        "file.status_changed",
        {
            "file_id": file_id,
            "owner": before["owner"],
            "from": before["status"],
            "to": to,
            "batch_id": before["batch_id"],
            "error": values.get("error"),
            "chunk_count": values.get("chunk_count", before["chunk_count"]),
        },
    )
    if to == CANCELLED:  # nothing of a cancelled file stays searchable
        conn.execute(delete(file_vectors).where(file_vectors.c.file_id == file_id))
        conn.execute(delete(chunks).where(chunks.c.file_id == file_id))
    batch_id = before["batch_id"]
    if batch_id and to in TERMINAL:
        row = _recount(conn, batch_id, to, +1, emit)
        if row is not None and row["status"] != "completed":
            if _progress_due(int(row["terminal"]), int(row["total"])):
                progress(conn, batch_id, row, emit)
            try_complete(conn, batch_id, emit)
    return before


# A batch reports its progress at most this many times (as a file turns terminal): a count
# per transition of every file would cost the batch quadratic work.
PROGRESS_REPORTS = 50


def _progress_due(terminal: int, total: int) -> bool:
    step = max(1, -(-total // PROGRESS_REPORTS))
    return terminal % step == 0 or terminal >= total


def progress(conn: Connection, batch_id: str, batch: Mapping[str, Any], emit: Emit) -> None:
    """``batch.progress``: how many of the batch's files are in each state, as the seed's
    (emitted as files turn terminal, at most :data:`PROGRESS_REPORTS` times a batch).
    ``batch`` is the batch row as just counted (its owner and total)."""
    rows = conn.execute(
        select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
    ).all()
    counts = {str(state): int(n) for state, n in rows}
    body: dict[str, Any] = {"batch_id": batch_id, "owner": batch["owner"], "total": batch["total"]}
    body.update({state: counts.get(state, 0) for state in PROGRESS_STATES})
    emit("batch.progress", body)


def revive(conn: Connection, file_id: str, to: str, emit: Emit) -> bool:
    """A failed file is retried from the DLQ: ``failed → to``, uncounted from its batch.

    The batch's counters always describe its files as they are now; a batch that has
    completed stays completed (``batch.completed`` fired once) and reports the change as
    ``batch.summary_changed``.
    """
    before = transition(conn, file_id, [FAILED], to, emit, error=None, error_type=None, failed_stage=None)
    if before is not None and before["batch_id"]:
        _recount(conn, before["batch_id"], FAILED, -1, emit)
    return before is not None


def _recount(conn: Connection, batch_id: str, outcome: str, delta: int, emit: Emit) -> RowMapping | None:
    """Move ``batch_id``'s terminal and ``outcome`` counters by ``delta``; returns the batch.

    A batch that has completed already (a member retried from the DLQ) reports its new
    totals as ``batch.summary_changed``.
    """
    column = {READY: batches.c.ready, FAILED: batches.c.failed, CANCELLED: batches.c.cancelled}[outcome]
    row = (
        conn.execute(
            update(batches)
            .where(batches.c.id == batch_id)
            .values({batches.c.terminal: batches.c.terminal + delta, column: column + delta})
            .returning(
                batches.c.status,
                batches.c.owner,
                batches.c.terminal,
                batches.c.total,
                batches.c.ready,
                batches.c.failed,
                batches.c.cancelled,
            )
        )
        .mappings()
        .one_or_none()
    )
    if row is not None and row["status"] == "completed":
        emit("batch.summary_changed", {"batch_id": batch_id, **_counts(row)})
    return row


def _counts(row: RowMapping) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "status"}


def count_upload(conn: Connection, batch_id: str, emit: Emit) -> None:
    """Count one more file in an open batch; the upload that reaches ``expected`` seals it.

    Raises :class:`BatchClosed` when the batch is sealed or full (under its row lock, so a
    seal racing the upload wins cleanly: the file is not counted and the caller drops it).
    """
    full = and_(batches.c.expected.is_not(None), batches.c.total + 1 >= batches.c.expected)
    row = (
        conn.execute(
            update(batches)
            .where(
                batches.c.id == batch_id,
                batches.c.sealed.is_(False),
                or_(batches.c.expected.is_(None), batches.c.total < batches.c.expected),
            )
            .values(
                total=batches.c.total + 1,
                sealed=case((full, True), else_=False),
                status=case((full, "processing"), else_=batches.c.status),
            )
            .returning(batches.c.sealed, batches.c.owner, batches.c.total)
        )
        .mappings()
        .one_or_none()
    )
    if row is None:
        raise BatchClosed(f"batch {batch_id} is sealed or has all its expected files")
    if row["sealed"]:
        emit("batch.sealed", {"batch_id": batch_id, "owner": row["owner"], "total": row["total"]})


def seal(conn: Connection, batch_id: str, emit: Emit, *, owner: str | None = None) -> RowMapping | None:
    """No more files: the batch completes once every counted file is terminal (maybe now).

    Idempotent; None when there is no such batch (of ``owner``, when given).
    """
    where = [batches.c.id == batch_id] + ([batches.c.owner == owner] if owner is not None else [])
    sealed_now = conn.execute(
        update(batches)
        .where(*where, batches.c.sealed.is_(False))
        .values(sealed=True, status="processing")
        .returning(batches.c.owner, batches.c.total)
    ).one_or_none()
    if sealed_now is not None:
        emit("batch.sealed", {"batch_id": batch_id, "owner": sealed_now.owner, "total": sealed_now.total})
        try_complete(conn, batch_id, emit)
    row = conn.execute(select(batches).where(*where)).mappings().one_or_none()
    return row


def try_complete(conn: Connection, batch_id: str, emit: Emit) -> bool:
    """Flip the batch to ``completed`` if sealed and every file is terminal; idempotent."""
    row = (
        conn.execute(
            update(batches)
            .where(
                batches.c.id == batch_id,
                batches.c.sealed.is_(True),
                batches.c.terminal >= batches.c.total,
                batches.c.status != "completed",
            )
            .values(status="completed", completed_at=db_now())
            .returning(
                batches.c.owner, batches.c.total, batches.c.ready, batches.c.failed, batches.c.cancelled
            )
        )
        .mappings()
        .one_or_none()
    )
    if row is None:
        return False
    emit("batch.completed", {"batch_id": batch_id, **dict(row)})
    return True


def replace_chunks(conn: Connection, file_id: str, owner: str, pieces: Sequence[Chunk]) -> None:
    """The file's chunk rows become ``pieces``: a rerun replaces them, never duplicates
    (and the vectors of the old ones go with them)."""
    conn.execute(delete(file_vectors).where(file_vectors.c.file_id == file_id))
    conn.execute(delete(chunks).where(chunks.c.file_id == file_id))
    insert_chunks(conn, file_id, owner, pieces)


def insert_chunks(conn: Connection, file_id: str, owner: str, pieces: Sequence[Chunk]) -> None:
    """Insert chunk rows under ``file_id`` (a file's id, or a staging key)."""
    if pieces:
        conn.execute(
            insert(chunks),
            [{"file_id": file_id, "owner": owner, "ordinal": c.ordinal, "text": c.text} for c in pieces],
        )


# Staging, for SQLite, where every write holds the one writer: inserting a chunk indexes
# its text (the full-text trigger), so a big document's chunks inserted in the outcome's
# transaction held the writer for seconds (7 s for 22 MB of text). Its chunks are written
# first, in short transactions, under a key no file has (invisible to search, which joins
# the file), and the outcome's transaction adopts them: a change of key, which the
# full-text index does not follow.
STAGE_BYTES = 256 * 1024  # text per staging transaction (~0.1 s of indexing)
DELETE_ROWS = 1000  # chunks per deleting transaction
_STAGING = uuid.UUID("5f0c1d2e-7a3b-4c8d-9e6f-a1b2c3d4e5f6")

Begin = Callable[[], AbstractContextManager[Connection]]


def staging_key(*parts: object) -> str:
    """The key a writer's chunks wait under (one per job attempt: never shared)."""
    return str(uuid.uuid5(_STAGING, ":".join(map(str, parts))))


def stage_chunks(
    begin: Begin, key: str, owner: str, pieces: Sequence[Chunk], between: Callable[[], None] = lambda: None
) -> None:
    """Insert ``pieces`` under ``key``, about :data:`STAGE_BYTES` of text a transaction
    (``between`` runs between them: a checkpoint)."""
    start, size = 0, 0
    for end, piece in enumerate(pieces, 1):
        size += len(piece.text)
        if size >= STAGE_BYTES or end == len(pieces):
            with begin() as conn:
                insert_chunks(conn, key, owner, pieces[start:end])
            start, size = end, 0
            between()


def drain_chunks(begin: Begin, file_id: str, *, while_status: str | None = None) -> None:
    """Delete the chunks under ``file_id`` (a file's, or a staging key's), a few at a
    time; with ``while_status``, only while the file is still in that state."""
    while True:
        with begin() as conn:
            if while_status is not None and file_status(conn, file_id) != while_status:
                return
            some = select(chunks.c.id).where(chunks.c.file_id == file_id).limit(DELETE_ROWS)
            if conn.execute(delete(chunks).where(chunks.c.id.in_(some))).rowcount < DELETE_ROWS:
                return


def adopt_chunks(conn: Connection, key: str, file_id: str) -> None:
    """In the outcome's transaction: the chunks staged under ``key`` become the file's
    (its old chunks and vectors go)."""
    conn.execute(delete(file_vectors).where(file_vectors.c.file_id == file_id))
    conn.execute(delete(chunks).where(chunks.c.file_id == file_id))
    conn.execute(update(chunks).where(chunks.c.file_id == key).values(file_id=file_id))
    conn.execute(delete(staging).where(staging.c.key == key))


def claim_staging(
    conn: Connection, key: str, file_id: str, job_id: str | None = None, attempt: int | None = None
) -> None:
    """Record who stages under ``key`` before anything is staged there: attempt
    ``attempt`` of ``job_id`` (in a fenced transaction), or no job (a re-embed). See
    :func:`sweep_staging`."""
    conn.execute(
        insert(staging).values(key=key, file_id=file_id, job_id=job_id, attempt=attempt, created_at=db_now())
    )


def staged_by(conn: Connection, job_id: str, *, before: int) -> list[str]:
    """The staging keys of ``job_id``'s attempts before ``before`` (what they left)."""
    return list(
        conn.execute(
            select(staging.c.key).where(staging.c.job_id == job_id, staging.c.attempt < before)
        ).scalars()
    )


def release_staging(begin: Begin, key: str) -> None:
    """Drain what was staged under ``key``, then forget the key."""
    drain_chunks(begin, key)
    with begin() as conn:
        conn.execute(delete(staging).where(staging.c.key == key))


def sweep_staging(engine: Engine, *, stale_after: float) -> int:
    """Release every dead staging key: nothing will adopt its chunks. A chunk attempt's
    key is dead once the attempt no longer owns its job (it died, or its job ended or was
    taken over): exact, since the job's ``attempts`` only grows, so an attempt that lost
    its job never owns it again and its fenced writes are refused from then on. A key no
    job owns (a re-embed's, in a caller's process) is dead once older than
    ``stale_after`` seconds. Returns how many keys were released."""
    lost = or_(jobs.c.id.is_(None), jobs.c.status != RUNNING, jobs.c.attempts != staging.c.attempt)
    dead = or_(
        and_(staging.c.job_id.is_not(None), lost),
        and_(staging.c.job_id.is_(None), staging.c.created_at < db_now_plus(-stale_after)),
    )
    with reading(engine) as conn:  # on SQLite, a reader: the writer only to release
        keys = list(
            conn.execute(
                select(staging.c.key)
                .select_from(staging.outerjoin(jobs, jobs.c.id == staging.c.job_id))
                .where(dead)
            ).scalars()
        )
    for key in keys:
        release_staging(engine.begin, key)
    return len(keys)


def retire_chunks(conn: Connection, file_id: str) -> str:
    """In a swap's transaction: the file's current chunks move out of its way, under a key
    of their own (recorded, no job: see :func:`sweep_staging`), to be released after the
    commit. Returns that key."""
    key = staging_key("retired", file_id, uuid.uuid4())
    claim_staging(conn, key, file_id)
    conn.execute(update(chunks).where(chunks.c.file_id == file_id).values(file_id=key))
    return key


def file_status(conn: Connection, file_id: str) -> str | None:
    """The file's status (None: no such file)."""
    found = conn.execute(select(files.c.status).where(files.c.id == file_id)).scalar_one_or_none()
    return None if found is None else str(found)


def chunk_texts(conn: Connection, file_id: str) -> list[tuple[int, str]]:
    """The file's chunks as ``(id, text)``, in order."""
    rows = conn.execute(
        select(chunks.c.id, chunks.c.text).where(chunks.c.file_id == file_id).order_by(chunks.c.ordinal)
    ).all()
    return [(int(r.id), str(r.text)) for r in rows]


def write_vectors(
    conn: Connection, file_id: str, owner: str, model: str, vectors: Sequence[tuple[int, bytes]]
) -> None:
    """Store the file's packed vectors, ``(chunk id, vector)`` in chunk order, as its one
    ``file_vectors`` row (replacing what was there)."""
    conn.execute(delete(file_vectors).where(file_vectors.c.file_id == file_id))
    if vectors:
        conn.execute(
            insert(file_vectors).values(
                file_id=file_id,
                owner=owner,
                model=model,
                chunk_ids=pack_ids([chunk_id for chunk_id, _ in vectors]),
                vectors=b"".join(vector for _, vector in vectors),
            )
        )


def embedded_chunks(conn: Connection, file_ids: Any) -> int:
    """How many chunk vectors the files' ``file_vectors`` rows hold (``file_ids``: a list
    or a subquery of file ids; 8 bytes a chunk id)."""
    size = conn.execute(
        select(func.coalesce(func.sum(func.length(file_vectors.c.chunk_ids)), 0)).where(
            file_vectors.c.file_id.in_(file_ids)
        )
    ).scalar_one()
    return int(size) // 8


def batch_summary(conn: Connection, batch_id: str) -> RowMapping | None:
    """The batch row."""
    return conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one_or_none()
