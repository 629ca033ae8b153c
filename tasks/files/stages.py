"""Stages of the files family: extract → chunk → embed per file, then complete_batch.

Each stage is thin: load the file by id, call the pure functions beside it, and move the
file to its next state in the job's own transaction. A stage that finds its file in an
unexpected state ends its job ``skipped`` (recording what it found) and passes the file
on. A file that fails for good is recorded ``failed`` with its DLQ entry, and the stage
*returns* a failed marker that later stages pass through: nothing raises out of a chord
header, so a failed file never blocks its batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection, select

from config.celery_app import platform
from config.settings import Settings, get_settings
from conveyor.context import JobContext
from conveyor.db.dialect import relax_commit
from conveyor.errors import SkipJob
from conveyor.retry import Backoff
from conveyor.store import new_event
from tasks.files import flow
from tasks.files.chunking import chunk_text
from tasks.files.embedding import Embedder, load_embedder
from tasks.files.extract import Limits, extract
from tasks.files.models import CHUNKING, EMBEDDING, EXTRACTING, FAILED, QUEUED, READY, TERMINAL
from tasks.files.storage import Storage, storage_for

QUEUE = "files"
RETRY = Backoff(cap=30.0)  # base: the backoff_base setting (1 s by default)
ATTEMPTS = 4  # the first try and 3 retries, delays in Postgres


class FileRef(BaseModel):
    """What flows from stage to stage: the file id and, once it failed, a marker."""

    model_config = ConfigDict(extra="ignore")
    file_id: str
    name: str | None = None  # only for people: the job label in lists and the DLQ
    failed: bool = False


class BatchRef(BaseModel):
    """The chord body's input: the batch id and the header's results."""

    model_config = ConfigDict(extra="ignore")
    batch_id: str
    results: list[Any] = []


def _settings() -> Settings:
    settings = platform.settings
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
        message = (str(error).strip() or type(error).__name__)[:500]
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
            "batch_id": row["batch_id"] if row is not None else None,
            "stage": stage,
            "retry_count": attempts,
        }
        _db_emit(conn)("file.processing_stalled", body)

    return hook


def _begin(ctx: JobContext, p: FileRef, accept_from: tuple[str, ...], working: str) -> Mapping[str, Any]:
    """Enter the stage: pass failed files on, skip files found in an unexpected state.

    ``working`` is the stage's own state (a retry finds the file there); ``accept_from``
    are the states the stage may move the file out of (extract: ``queued``), committed at
    once so that the stage shows while it runs. Returns the file row.
    """
    if p.failed:
        raise SkipJob("file already failed", p.model_dump())
    if accept_from:
        # Its own transaction, before the job's: a second connection opened while the
        # job's holds SQLite's write lock would wait for it forever.
        with platform.engine.begin() as conn:
            relax_commit(conn)  # a progress state: a retry from ``queued`` sets it again
            row = flow.get_file(conn, p.file_id)
            found = str(row["status"]) if row is not None else "missing"
            moved = None
            if found in accept_from:
                moved = flow.transition(conn, p.file_id, [found], working, _db_emit(conn))
        if moved is not None:
            return {**moved, "status": working}
    else:
        row = flow.get_file(ctx.connection, p.file_id)
        found = str(row["status"]) if row is not None else "missing"
    if found == working and row is not None:
        return row
    failed = found in TERMINAL and found != READY
    raise SkipJob(f"file found {found}", {"file_id": p.file_id, "name": p.name, "failed": failed})


def _db_emit(conn: Connection) -> flow.Emit:
    return lambda topic, body: platform.store.emit(conn, [new_event(None, topic, dict(body))])


def _file_stage(verb: str, **policy: Any) -> Any:
    """The policy every per-file stage shares; ``policy`` adds to it."""
    return platform.stage(
        f"conveyor.files.{verb}",
        payload=FileRef,
        queue=QUEUE,
        retry=RETRY,
        max_attempts=ATTEMPTS,
        label=_label,
        concurrency=get_settings().files.concurrency.get(verb),
        on_dead=_on_dead(verb),
        on_retry=_on_retry(verb),
        on_stalled=_on_stalled(verb),
        **policy,
    )


@_file_stage("extract", soft_time_limit=get_settings().files.extract_soft_time_limit)
def extract_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Read the content by reference and extract its text (PDF, DOCX, HTML, Markdown, text)."""
    row = _begin(ctx, p, (QUEUED,), EXTRACTING)
    limits = Limits(max_bytes=_settings().files.max_bytes, max_pages=_settings().files.max_pages)
    result = extract(_storage(row["content_ref"]).get(row["content_ref"]), name=row["name"], limits=limits)
    flow.transition(
        ctx.connection,
        p.file_id,
        [EXTRACTING],
        CHUNKING,
        _emitter(ctx),
        text=result.text,
        mime=result.mime,
        pages=result.pages,
    )
    return {"file_id": p.file_id, "name": p.name}


@_file_stage("chunk")
def chunk_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Split the text into overlapping, token-bounded chunks."""
    row = _begin(ctx, p, (), CHUNKING)
    conn = ctx.connection
    settings = _settings().files
    pieces = chunk_text(row["text"] or "", max_tokens=settings.chunk_tokens, overlap=settings.chunk_overlap)
    flow.replace_chunks(conn, p.file_id, row["owner"], pieces)
    flow.transition(conn, p.file_id, [CHUNKING], EMBEDDING, _emitter(ctx), chunk_count=len(pieces))
    return {"file_id": p.file_id, "name": p.name}


@_file_stage("embed")
def embed_stage(ctx: JobContext, p: FileRef) -> dict[str, Any]:
    """Embed every chunk and mark the file ``ready`` (counted in its batch)."""
    _begin(ctx, p, (), EMBEDDING)
    conn = ctx.connection
    flow.embed_chunks(conn, p.file_id, _embedder(_settings().files.embedder))
    before = flow.transition(conn, p.file_id, [EMBEDDING], READY, _emitter(ctx))
    if before is None:
        raise SkipJob("file left embedding meanwhile", {"file_id": p.file_id, "name": p.name})
    return {"file_id": p.file_id, "name": p.name}


@platform.stage("conveyor.files.complete_batch", payload=BatchRef, queue=QUEUE, label=lambda p: p.batch_id)
def complete_batch(ctx: JobContext, p: BatchRef) -> dict[str, Any]:
    """The chord body: only asks Postgres whether the batch is complete (idempotent)."""
    flow.try_complete(ctx.connection, p.batch_id, _emitter(ctx))
    summary = flow.batch_summary(ctx.connection, p.batch_id)
    return {k: summary[k] for k in ("total", "ready", "failed", "cancelled", "status")} if summary else {}


class NoArgs(BaseModel):
    """No payload."""


@platform.stage("conveyor.files.reconcile", payload=NoArgs, queue=QUEUE)
def reconcile(ctx: JobContext, p: NoArgs) -> dict[str, int]:
    """Periodic: complete any sealed batch whose files are all terminal (lost chord counter)."""
    from tasks.files.models import batches

    conn = ctx.connection
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
    done = sum(1 for b in open_ids if flow.try_complete(conn, b, _emitter(ctx)))
    return {"completed": done}
