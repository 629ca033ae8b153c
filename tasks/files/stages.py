"""Stages of the files family: extract → chunk → embed per file, then complete_batch.

Each stage is thin: load the file by id, call the pure functions beside it, and move the
file to its next state in the job's own transaction. A stage that finds its file in an
unexpected state ends its job ``skipped`` (recording what it found) and passes the file
on. A file that fails for good is recorded ``failed`` with its DLQ entry, and the stage
*returns* a failed marker that later stages pass through: nothing raises out of a chord
header, so a failed file never blocks its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection, delete, select

from config.settings import Settings, get_settings
from conveyor.context import JobContext
from conveyor.errors import OutOfBounds, SkipJob, describe
from conveyor.logs import redact_text
from conveyor.retry import Backoff
from conveyor.shared import current_platform, stage
from conveyor.store.db.dialect import db_now_plus, relax_commit
from conveyor.store.db.engine import reading
from conveyor.store.jobs import new_event
from conveyor.worker.isolate import run_bounded
from tasks.files import flow
from tasks.files.chunking import chunk_text, fit_chunks
from tasks.files.embedding import Embedder, TokenBudget, embed_packed, load_embedder
from tasks.files.errors import DocumentTooComplex
from tasks.files.extract import Limits, extract
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
    UPLOADING,
    batches,
    files,
)
from tasks.files.storage import Storage, storage_for, too_large

log = logging.getLogger("conveyor.files")

QUEUES = {"extract": "file-extract", "chunk": "file-chunk", "embed": "file-embed"}
BATCH_QUEUE = "batch-completion"
_MIB = 1024 * 1024
RETRY = Backoff(cap=30.0)  # base: the backoff_base setting (1 s by default)
ATTEMPTS = 4  # the first try and 3 retries, delays in Postgres


class FileRef(BaseModel):
    """What flows from stage to stage: the file id and, once it failed, a marker."""

    model_config = ConfigDict(extra="ignore")
    file_id: str
    name: str | None = None  # only for people: the job label in lists and the DLQ
    failed: bool = False


class BatchRef(BaseModel):
    """The chord body's input: the batch id (header results, if a caller passes them, are
    ignored: the database knows each file's outcome)."""

    model_config = ConfigDict(extra="ignore")
    batch_id: str


def _settings() -> Settings:
    settings = current_platform().settings
    return settings if isinstance(settings, Settings) else get_settings()


@cache
def _embedder(name: str) -> Embedder:
    return load_embedder(name)


def _storage(ref: str) -> Storage:
    settings = _settings()
    return storage_for(ref, local_root=settings.files_storage_dir(), s3=settings.files.s3)


def _emitter(ctx: JobContext) -> flow.Emit:
    return lambda topic, body: ctx.emit(topic, dict(body))


def _label(p: FileRef) -> str:
    return p.name or p.file_id


def _on_dead(stage: str) -> Any:
    """Record the file ``failed`` (counted in its batch) in the dead-letter transaction."""

    def hook(conn: Connection, payload: Any, error: BaseException) -> dict[str, Any]:
        file_id = str((payload or {}).get("file_id", ""))
        message = redact_text(describe(error))[:500]
        flow.transition(
            conn,
            file_id,
            [QUEUED, EXTRACTING, CHUNKING, EMBEDDING],
            FAILED,
            _db_emit(conn),
            error=message,
            error_type=type(error).__name__,
            failed_stage=stage,
        )
        return {"file_id": file_id, "name": (payload or {}).get("name"), "failed": True, "error": message}

    return hook


WORKING = {"extract": QUEUED, "chunk": CHUNKING, "embed": EMBEDDING}


def _on_retry(stage: str) -> Any:
    """A DLQ retry of this stage: the file goes back to where the stage picks it up."""

    def hook(conn: Connection, payload: Any) -> None:
        flow.revive(conn, str((payload or {}).get("file_id", "")), WORKING[stage], _db_emit(conn))

    return hook


def _on_stalled(stage: str) -> Any:
    """The worker running this stage died mid-file: say so (``file.processing_stalled``)."""

    def hook(conn: Connection, payload: Any, attempts: int) -> None:
        file_id = str((payload or {}).get("file_id", ""))
        row = flow.get_file(conn, file_id)
        body = {
            "file_id": file_id,
            "owner": row["owner"] if row is not None else None,
            "batch_id": row["batch_id"] if row is not None else None,
            "stage": stage,
            "retry_count": attempts,
        }
        _db_emit(conn)("file.processing_stalled", body)

    return hook


def _found(file_id: str) -> str:
    with reading(current_platform().engine) as conn:
        row = flow.get_file(conn, file_id)
    return str(row["status"]) if row is not None else "missing"


def _skip(p: FileRef, found: str) -> SkipJob:
    """The file is not where this stage expects it: end the job ``skipped``, write nothing.

    A file found failed or cancelled goes on marked failed, so later stages skip at once.
    """
    failed = found in TERMINAL and found != READY
    return SkipJob(f"file found {found}", {"file_id": p.file_id, "name": p.name, "failed": failed})


def _begin(ctx: JobContext, p: FileRef, accept_from: tuple[str, ...], working: str) -> Mapping[str, Any]:
    """Enter the stage: pass failed files on, skip files found in an unexpected state.

    ``working`` is the stage's own state (a retry finds the file there); ``accept_from``
    are the states the stage may move the file out of (extract: ``queued``), committed at
    once so that the stage shows while it runs. Everything else is read without the
    writer: on SQLite no stage computes inside a write transaction. Returns the file row.
    """
    if p.failed:
        raise SkipJob("file already failed", p.model_dump())
    if accept_from:
        # Its own brief transaction, before the job's: the state shows while the stage runs.
        with current_platform().engine.begin() as conn:
            relax_commit(conn)  # a progress state: a retry from ``queued`` sets it again
            row = flow.get_file(conn, p.file_id)
            found = str(row["status"]) if row is not None else "missing"
            moved = None
            if found in accept_from:
                moved = flow.transition(conn, p.file_id, [found], working, _db_emit(conn))
        if moved is not None:
            return {**moved, "status": working}
    else:
        with reading(current_platform().engine) as conn:
            row = flow.get_file(conn, p.file_id)
        found = str(row["status"]) if row is not None else "missing"
    if found == working and row is not None:
        return row
    raise _skip(p, found)


def _advance(ctx: JobContext, p: FileRef, from_state: str, to: str, **values: Any) -> None:
    """The stage's outcome, first in the job's transaction (the writes follow it): a file
    that moved meanwhile (cancelled, taken by another copy) ends the job ``skipped``."""
    if flow.transition(ctx.connection, p.file_id, [from_state], to, _emitter(ctx), **values) is None:
        raise _skip(p, _found(p.file_id))


def _db_emit(conn: Connection) -> flow.Emit:
    return lambda topic, body: current_platform().store.emit(conn, [new_event(None, topic, dict(body))])


def _file_stage(verb: str, **policy: Any) -> Any:
    """The policy every per-file stage shares; ``policy`` adds to it."""
    return stage(
        f"conveyor.files.{verb}",
        payload=FileRef,
        queue=QUEUES[verb],
        retry=RETRY,
        max_attempts=ATTEMPTS,
        label=_label,
        concurrency=get_settings().files.concurrency.get(verb),
        on_dead=_on_dead(verb),
        on_retry=_on_retry(verb),
        on_stalled=_on_stalled(verb),
        **policy,
    )


def _extract_file(path: str, name: str | None, max_bytes: int, max_pages: int) -> dict[str, Any]:
    """In the bounded child: read the stored file and extract its text."""
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    result = extract(data, name=name, limits=Limits(max_bytes=max_bytes, max_pages=max_pages))
    return {
        "text": result.text,
        "mime": result.mime,
        "pages": result.pages,
        "encoding": result.encoding,
    }


# Small text (plain, Markdown, HTML) is parsed in the worker itself: its parse costs a small
# multiple of its size, and Python code stays interruptible by the soft time limit. PDFs,
# archives (DOCX) and anything larger go to the bounded child, whatever their size: a few
# kilobytes of them may unpack into gigabytes. The fork costs ~10 ms a file.
INLINE_MAX = 256 * 1024
_CONTAINERS = (b"%PDF", b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")


def _is_container(path: Path) -> bool:
    with path.open("rb") as handle:
        head = handle.read(1024)
    return any(magic in head for magic in _CONTAINERS)


def memory_bound(max_bytes: int) -> int:
    """How much a worker's memory may grow for one document: max(2 * max_bytes, 256 MiB)."""
    return max(2 * max_bytes, 256 * _MIB)


@_file_stage("extract", soft_time_limit=get_settings().files.extract_soft_time_limit)
def extract_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Read the content by reference and extract its text (PDF, DOCX, HTML, Markdown, text).

    The stored size is checked before anything is read, and the parsing runs in a child
    process bounded in memory and time: a hostile document is refused as "document too
    complex" instead of taking the worker with it.
    """
    row = _begin(ctx, p, (QUEUED,), EXTRACTING)
    settings = _settings().files
    ref = row["content_ref"]
    storage = _storage(ref)
    size = storage.size(ref)
    if size > settings.max_bytes:
        raise too_large(settings.max_bytes, size)
    bound = memory_bound(settings.max_bytes)
    timeout = settings.extract_soft_time_limit * 0.9
    args = (row["name"], settings.max_bytes, settings.max_pages)
    with storage.local_path(ref) as path:
        if size <= INLINE_MAX and not _is_container(path):
            out = _extract_file(str(path), *args)
        else:
            try:
                out = run_bounded(_extract_file, str(path), *args, memory=bound, timeout=timeout)
            except OutOfBounds as exc:
                limit = f"{bound // _MIB} MiB of memory" if exc.reason == "memory" else f"{timeout:.0f} s"
                raise DocumentTooComplex(
                    f"document too complex: extracting it needs more than {limit}"
                ) from exc
    _advance(
        ctx, p, EXTRACTING, CHUNKING,
        text=out["text"], mime=out["mime"], pages=out["pages"], encoding=out["encoding"],
    )  # fmt: skip
    return {"file_id": p.file_id, "name": p.name}


@_file_stage("chunk")
def chunk_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Split the text into overlapping, token-bounded chunks (computed before any write)."""
    row = _begin(ctx, p, (), CHUNKING)
    settings = _settings().files
    pieces = chunk_text(row["text"] or "", max_tokens=settings.chunk_tokens, overlap=settings.chunk_overlap)
    embedder = _embedder(settings.embedder)
    if isinstance(embedder, TokenBudget):  # a model that would silently cut a longer chunk
        pieces = fit_chunks(pieces, embedder.count_tokens, embedder.max_tokens)
    if current_platform().engine.dialect.name != "sqlite":
        _advance(ctx, p, CHUNKING, EMBEDDING, chunk_count=len(pieces))
        flow.replace_chunks(ctx.connection, p.file_id, row["owner"], pieces)
        return {"file_id": p.file_id, "name": p.name}
    # SQLite: the chunks are staged in short transactions first (see flow.stage_chunks).
    key = flow.staging_key(ctx.job_id, ctx.attempt)
    try:
        with reading(current_platform().engine) as conn:
            left = flow.staged_by(conn, ctx.job_id, before=ctx.attempt)
        for earlier in left:  # what an attempt that died left staged
            flow.release_staging(ctx.fenced, earlier)
        with ctx.fenced() as conn:
            flow.claim_staging(conn, key, p.file_id, ctx.job_id, ctx.attempt)
        flow.drain_chunks(ctx.fenced, p.file_id, while_status=CHUNKING)  # a rerun's old chunks
        flow.stage_chunks(ctx.fenced, key, row["owner"], pieces, between=lambda: ctx.checkpoint(fresh=False))
        _advance(ctx, p, CHUNKING, EMBEDDING, chunk_count=len(pieces))
        flow.adopt_chunks(ctx.connection, key, p.file_id)
    except BaseException:
        ctx.rollback()  # the outcome's transaction holds the writer the discard needs
        _discard_staged(key)
        raise
    return {"file_id": p.file_id, "name": p.name}


def _discard_staged(key: str) -> None:
    """Best effort (the job's next attempt, or else the reconciler's sweep, also clears
    them): staged chunks no outcome will adopt."""
    try:
        flow.release_staging(current_platform().engine.begin, key)
    except Exception:
        log.warning("could not discard staged chunks %s; the sweep will", key, exc_info=True)


# Texts per embedding call: wordllama's working arrays grow with the batch (a 22 MB
# document's 18,500 chunks peaked 150 MiB above the model at 256 a call, 22 MiB at 16,
# no slower), and a worker's memory is bounded.
EMBED_BATCH = 16


@_file_stage("embed")
def embed_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Embed every chunk and mark the file ``ready`` (counted in its batch).

    Vectors are computed (and packed, batch by batch) before the job's transaction opens.
    """
    row = _begin(ctx, p, (), EMBEDDING)
    embedder = _embedder(_settings().files.embedder)
    with reading(current_platform().engine) as conn:
        texts = flow.chunk_texts(conn, p.file_id)
    vectors = embed_packed(embedder, texts, batch=EMBED_BATCH, between=lambda: ctx.checkpoint(fresh=False))
    del texts
    _advance(ctx, p, EMBEDDING, READY)
    flow.write_vectors(ctx.connection, p.file_id, row["owner"], embedder.name, vectors)
    return {"file_id": p.file_id, "name": p.name}


@stage("conveyor.files.complete_batch", payload=BatchRef, queue=BATCH_QUEUE, label=lambda p: p.batch_id)
def complete_batch(ctx: JobContext, p: BatchRef) -> dict[str, Any]:
    """The chord body: only asks the database whether the batch is complete (idempotent)."""
    flow.try_complete(ctx.connection, p.batch_id, _emitter(ctx))
    summary = flow.batch_summary(ctx.connection, p.batch_id)
    return {k: summary[k] for k in ("total", "ready", "failed", "cancelled", "status")} if summary else {}


class NoArgs(BaseModel):
    """No payload."""


@stage("conveyor.files.reconcile", payload=NoArgs, queue=BATCH_QUEUE)
def reconcile(ctx: JobContext, p: NoArgs) -> dict[str, int]:
    """Periodic: complete any sealed batch whose files are all terminal (lost chord counter),
    sweep uploads whose process died half way (their object, then their row), and drain
    what dead chunk attempts staged.

    The sweeps go first, each in transactions of its own: on SQLite the job's transaction
    (``ctx.connection``, for the completions) holds the one writer until the job ends, so
    a sweep after a completion waited for it forever. Cancelling unconfirmed files first
    also lets their batches complete in this same pass."""
    engine = current_platform().engine
    stale = _settings().files.stale_upload_after
    swept = sweep_uploads(older_than=stale)
    unconfirmed = cancel_unconfirmed(older_than=stale)
    unstaged = flow.sweep_staging(engine, stale_after=stale)
    with reading(engine) as conn:
        open_ids = (
            conn.execute(
                select(batches.c.id).where(
                    batches.c.sealed.is_(True),
                    batches.c.status != "completed",
                    batches.c.terminal >= batches.c.total,
                )
            )
            .scalars()
            .all()
        )
    done = sum(1 for b in open_ids if flow.try_complete(ctx.connection, b, _emitter(ctx)))
    return {"completed": done, "swept": swept, "unconfirmed": unconfirmed, "unstaged": unstaged}


def cancel_unconfirmed(*, older_than: float) -> int:
    """Cancel files of sealed batches uploaded but never confirmed (the request that should
    have confirmed them died), so that their batches complete; returns how many."""
    with reading(current_platform().engine) as conn:
        stale = (
            conn.execute(
                select(files.c.id)
                .join(batches, batches.c.id == files.c.batch_id)
                .where(
                    files.c.status == UPLOADED,
                    files.c.updated_at < db_now_plus(-older_than),
                    batches.c.sealed.is_(True),
                )
            )
            .scalars()
            .all()
        )
    cancelled = 0
    for file_id in stale:
        with current_platform().engine.begin() as conn:
            error = f"never confirmed within {older_than:.0f} s of its upload"
            cancelled += (
                flow.transition(conn, file_id, [UPLOADED], CANCELLED, _db_emit(conn), error=error) is not None
            )
    return cancelled


def sweep_uploads(*, older_than: float) -> int:
    """Remove uploads that never finished (their process died): object first, then row."""
    with reading(current_platform().engine) as conn:
        stale = conn.execute(
            select(files.c.id, files.c.content_ref).where(
                files.c.status == UPLOADING, files.c.updated_at < db_now_plus(-older_than)
            )
        ).all()
    swept = 0
    for file_id, ref in stale:
        try:
            swept += discard_upload(file_id, ref)
        except Exception:
            log.warning("could not delete the object of stale upload %s", file_id, exc_info=True)
    return swept


def discard_upload(file_id: str, ref: str) -> bool:
    """Remove an unfinished upload: its object first (a failure leaves the row to try
    again), then its row while still ``uploading``. True when the row went."""
    _storage(ref).delete(ref)
    with current_platform().engine.begin() as conn:
        return bool(
            conn.execute(delete(files).where(files.c.id == file_id, files.c.status == UPLOADING)).rowcount
        )
