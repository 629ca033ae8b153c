"""The file state machine and batch accounting, as SQL on the caller's connection.

Every transition is a compare-and-set on the file's status. A file's terminal transition
(ready, failed, cancelled) increments its batch's counters in the same transaction, and
the transaction that makes ``sealed AND terminal = total`` flips the batch to
``completed`` by compare-and-set: ``batch.completed`` is written exactly once, whatever
the chord does. The chord callback and the reconciler only call :func:`try_complete`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, update
from sqlalchemy.engine import RowMapping

from conveyor.db.dialect import db_now
from tasks.files.chunking import Chunk
from tasks.files.embedding import Embedder, pack
from tasks.files.models import CANCELLED, FAILED, READY, TERMINAL, batches, chunks, files

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
            "from": before["status"],
            "to": to,
            "batch_id": before["batch_id"],
            "error": values.get("error"),
            "chunk_count": values.get("chunk_count", before["chunk_count"]),
        },
    )
    if to in TERMINAL and before["batch_id"]:
        count_terminal(conn, before["batch_id"], to, emit)
    return before


def count_terminal(conn: Connection, batch_id: str, outcome: str, emit: Emit) -> None:
    """One more terminal file in ``batch_id``; completes the batch if that was the last."""
    row = _recount(conn, batch_id, outcome, +1, emit)
    if row is None or row["status"] == "completed":
        return
    emit("batch.progress", {"batch_id": batch_id, **_counts(row)})
    try_complete(conn, batch_id, emit)


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
            .returning(batches.c.total, batches.c.ready, batches.c.failed, batches.c.cancelled)
        )
        .mappings()
        .one_or_none()
    )
    if row is None:
        return False
    emit("batch.completed", {"batch_id": batch_id, **dict(row)})
    return True


def replace_chunks(conn: Connection, file_id: str, owner: str, pieces: Sequence[Chunk]) -> None:
    """The file's chunk rows become ``pieces``: a rerun replaces them, never duplicates."""
    conn.execute(delete(chunks).where(chunks.c.file_id == file_id))
    if pieces:
        conn.execute(
            insert(chunks),
            [{"file_id": file_id, "owner": owner, "ordinal": c.ordinal, "text": c.text} for c in pieces],
        )


def embed_chunks(conn: Connection, file_id: str, embedder: Embedder) -> int:
    """Embed the file's chunks and store their vectors (one round trip); returns how many."""
    rows = conn.execute(
        select(chunks.c.id, chunks.c.text).where(chunks.c.file_id == file_id).order_by(chunks.c.ordinal)
    ).all()
    if rows:  # psycopg pipelines the executemany
        vectors = embedder.embed([r.text for r in rows])
        conn.execute(
            update(chunks).where(chunks.c.id == bindparam("chunk_id")),
            [
                {"chunk_id": r.id, "embedding": pack(v), "model": embedder.name}
                for r, v in zip(rows, vectors, strict=True)
            ],
        )
    return len(rows)


def batch_summary(conn: Connection, batch_id: str) -> RowMapping | None:
    """The batch row."""
    return conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one_or_none()
