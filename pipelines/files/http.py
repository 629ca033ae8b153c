"""The files family's batches over HTTP: open one, upload its files (streamed,
size-limited), confirm each, seal, follow, cancel, retry the failed ones.

``conveyor serve`` adds this router to the API (``HTTP_EXTENSIONS`` in
``config/celery_app.py``). The flow is :mod:`pipelines.files`' on the deployment's
platform: ``POST /batches`` → ``POST /batches/{id}/files?name=`` per file (the request
body is the file's content) → ``POST /files/{id}/confirm`` per file → ``POST
/batches/{id}/seal`` (or the last expected upload seals it); the batch completes once
sealed and every file in it is terminal (``batch.completed`` on ``GET /events?batch=``).

A batch and its files belong to the token's owner; another owner's are 404, as if they
did not exist, unless the token is ``admin`` (an admin's upload joins the batch's owner).
An upload is streamed to storage as it arrives, a chunk at a time: refused (413) before
anything is read when its ``Content-Length`` is over ``files.max_bytes``, else as soon
as that many bytes arrived, and then nothing of it is kept.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Annotated, Any, Literal, cast

import anyio
import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, Body, Path, Query, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import RowMapping
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from conveyor.errors import RetryRefused
from conveyor.platform import Platform
from conveyor.web.auth import Caller, Reader, Submitter
from conveyor.web.limits import streamed
from conveyor.web.models import STRICT
from conveyor.web.problems import Problem, responses, unavailable
from pipelines import files as pipeline
from tasks.files import flow
from tasks.files.errors import FileRejected, FileTooLarge, StorageUnavailable, UploadInterrupted
from tasks.files.flow import BatchClosed
from tasks.files.storage import StorageRejected, too_large

log = logging.getLogger("conveyor.files")
router = APIRouter(tags=["batches"])

AUTH = (401, 403)
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
BatchId = Annotated[str, Path(min_length=1, max_length=64, description="the batch's id")]
FileId = Annotated[str, Path(min_length=1, max_length=64, description="the file's id")]
NAME_MAX = 1000  # characters of ?name= (stored names keep their last 500)
# Uploads stream in threads of their own: slow ones wait for their senders there, never
# holding the threads every other endpoint runs in (more uploads than this queue up).
UPLOADS_AT_ONCE = 32

FileStatus = Literal[
    "uploaded", "queued", "extracting", "chunking", "embedding", "ready", "failed", "cancelled"
]


# -- documents ----------------------------------------------------------------------------


class NewBatch(BaseModel):
    """A batch to open."""

    model_config = STRICT  # as the core API's bodies: `true` is not a count

    expected: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="how many files will come: the upload of the last one seals the batch (0: it "
        "completes at once); without it, seal the batch yourself",
    )


class Batch(BaseModel):
    """A batch's state and counters (a file is counted in ``total`` once uploaded, and in
    ``terminal`` once ready, failed or cancelled)."""

    id: str
    owner: str
    status: Literal["open", "processing", "completed"] = Field(
        description="open: takes files; processing: sealed, files still running; completed"
    )
    sealed: bool
    expected: int | None
    total: int
    terminal: int
    ready: int
    failed: int
    cancelled: int
    created_at: dt.datetime
    completed_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Batch:
        """The document of a ``file_batches`` row."""
        return cls(**{name: row[name] for name in cls.model_fields})


class FileState(BaseModel):
    """One file of a batch: where it is, and why it failed if it did."""

    id: str
    name: str
    status: FileStatus
    error_type: str | None
    error: str | None


class BatchDetail(Batch):
    """A batch and each of its files, oldest first."""

    files: list[FileState]


class UploadedFile(BaseModel):
    """A file stored and counted in its batch: confirm it to process it."""

    id: str
    batch_id: str
    name: str = Field(description="the name as kept: its last path segment, without control characters")
    size: int
    checksum: str = Field(description="SHA-256 of the content, hex")
    status: FileStatus


class ConfirmedFile(BaseModel):
    """The answer to a confirm."""

    id: str
    confirmed: bool = Field(description="true: this call queued the file; false: it was confirmed before")
    status: FileStatus


class CancelledBatch(BaseModel):
    """A cancelled batch: sealed, and its files that had not finished cancelled."""

    cancelled: int = Field(description="files this call cancelled")
    batch: Batch


class RetriedFiles(BaseModel):
    """The failed files sent back to the stage they failed in."""

    retried: int
    job_ids: list[str]


# -- helpers ------------------------------------------------------------------------------


def _platform() -> Platform:
    """The deployment's platform (its app module is loaded by the time a request comes)."""
    from config.celery_app import platform

    return platform


def _owner(caller: Caller) -> str | None:
    """The owner a caller's reads and writes are limited to (None: an admin, any owner)."""
    return None if caller.token.admin else caller.owner


def _not_found(kind: str, value: str) -> Problem:
    shown = f" {value}" if _ID.fullmatch(value) else ""
    return Problem(404, "not-found", "Not Found", f"no {kind}{shown}")


def _checked(kind: str, value: str) -> str:
    """``value`` if it can be an id (a UUID) at all; else 404 without asking the database
    (which would refuse some strings, NUL among them, rather than find nothing)."""
    if not _ID.fullmatch(value):
        raise _not_found(kind, value)
    return value


@contextmanager
def _answers(kind: str, value: str) -> Iterator[None]:
    """The pipeline's errors as problem documents."""
    try:
        yield
    except KeyError:
        raise  # a bug, not a missing batch
    except LookupError:
        raise _not_found(kind, value) from None
    except BatchClosed as exc:
        raise Problem(409, "batch-closed", "Batch closed", str(exc)) from None
    except FileTooLarge as exc:
        raise Problem(413, "file-too-large", "File too large", str(exc)) from None
    except UploadInterrupted as exc:
        raise Problem(400, "upload-interrupted", "Upload interrupted", str(exc)) from None
    except (StorageUnavailable, StorageRejected) as exc:  # not the caller's doing; keys stay ours
        log.warning("file storage failed: %s", exc)
        raise unavailable("the file storage did not answer; try again") from None
    except FileRejected as exc:
        raise Problem(422, "file-rejected", "File rejected", str(exc)) from None
    except RetryRefused as exc:
        raise Problem(409, "retry-refused", "Conflict", str(exc)) from None


def _batch(platform: Platform, batch_id: str, owner: str | None) -> Batch:
    return Batch.from_row(pipeline.batch_status(platform, batch_id, owner=owner)["batch"])


# -- endpoints ----------------------------------------------------------------------------


@router.post(
    "/batches",
    status_code=201,
    response_model=Batch,
    operation_id="createBatch",
    summary="Open a batch",
    description="Scope `submit`. The batch belongs to the token's owner. With `expected`, the "
    "upload of the last expected file seals it; without, seal it once every file is uploaded.",
    responses=responses(*AUTH, 422, 503),
)
def create_batch(
    request: Request,
    response: Response,
    caller: Submitter,
    body: Annotated[NewBatch | None, Body()] = None,
) -> Batch:
    """A new batch of the caller's owner."""
    platform = _platform()
    batch_id = pipeline.new_batch(platform, caller.owner, expected=body.expected if body else None)
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/batches/{batch_id}"
    return _batch(platform, batch_id, None)


@router.get(
    "/batches/{batch_id}",
    response_model=BatchDetail,
    operation_id="getBatch",
    summary="Show a batch and its files",
    description="Scope `read`. The batch's counters and each file's state (files still being "
    "uploaded are not listed). Another owner's batch is 404 unless the token is `admin`.",
    responses=responses(*AUTH, 404, 503),
)
def show_batch(caller: Reader, batch_id: BatchId) -> BatchDetail:
    """The batch's counters and its files' states."""
    with _answers("batch", batch_id):
        status = pipeline.batch_status(_platform(), _checked("batch", batch_id), owner=_owner(caller))
    return BatchDetail(
        **Batch.from_row(status["batch"]).model_dump(),
        files=[FileState(**{k: f[k] for k in FileState.model_fields}) for f in status["files"]],
    )


class _Body:
    """The request's body as a blocking binary stream, read from a worker thread: each
    ``read`` waits for the next chunk the server received, so no more than one chunk is
    held at a time. A client gone half way is an ``OSError`` (the pipeline's
    :class:`UploadInterrupted`)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""
        self._ended = False

    async def _next(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return b""

    @property
    def ended(self) -> bool:
        """Whether the whole body was read."""
        return self._ended

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (what is at hand when negative); ``b""`` at the end."""
        while not self._pending and not self._ended:
            try:
                self._pending = anyio.from_thread.run(self._next)
            except ClientDisconnect as exc:
                raise OSError("the client went away before the upload ended") from exc
        cut = len(self._pending) if size < 0 else size
        block, self._pending = self._pending[:cut], self._pending[cut:]
        return block


def _max_bytes() -> int:
    from tasks.files.stages import _settings

    return _settings().files.max_bytes


def _uploads(request: Request) -> anyio.CapacityLimiter:
    """The threads uploads stream in (one set per app)."""
    state = request.app.state
    limiter: anyio.CapacityLimiter | None = getattr(state, "files_uploads", None)
    if limiter is None:
        limiter = state.files_uploads = anyio.CapacityLimiter(UPLOADS_AT_ONCE)
    return limiter


def _upload_owner(platform: Platform, batch_id: str, caller: Caller) -> str:
    """Whose the upload is: the batch's owner, when the caller may see the batch (else 404)."""
    with platform.engine.connect() as conn:
        row = flow.batch_summary(conn, batch_id)
    if row is None or not caller.sees(row["owner"]):
        raise _not_found("batch", batch_id)
    return str(row["owner"])


@router.post(
    "/batches/{batch_id}/files",
    status_code=201,
    response_model=UploadedFile,
    operation_id="uploadFile",
    summary="Upload a file into a batch",
    description="Scope `submit`. The request body is the file's content, as it is (any "
    "`Content-Type` but a multipart form: `curl --data-binary @report.pdf`), streamed to storage "
    "as it arrives; `name` is the file's name. Over `files.max_bytes` (25 MiB by default) it is "
    "refused with 413: before anything is read when `Content-Length` says so, else once that much "
    "arrived (nothing of it is kept). The file is `uploaded` and counted in its batch: confirm it to "
    "process it. 409 when the batch is sealed or has its expected count.",
    responses=responses(*AUTH, 404, 409, 413, 415, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "the file's content",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
@streamed
async def upload_file(
    request: Request,
    caller: Submitter,
    batch_id: BatchId,
    name: Annotated[str, Query(min_length=1, max_length=NAME_MAX, description="the file's name")],
) -> UploadedFile:
    """Stream the body into storage as a new file of the batch."""
    body = _Body(request.stream())
    try:
        return await _store(request, caller, batch_id, name, body)
    except Problem as problem:
        if not body.ended:
            # Refused before the body's end: close the connection after the answer, or the
            # server would read the rest (however long) to keep the connection open.
            problem.headers["Connection"] = "close"
        raise


async def _store(request: Request, caller: Caller, batch_id: str, name: str, body: _Body) -> UploadedFile:
    if request.headers.get("content-type", "").lower().startswith("multipart/"):
        detail = "send the file's content as the request body itself (curl --data-binary @FILE), not a form"
        raise Problem(415, "unsupported-media-type", "Unsupported Media Type", detail)
    max_bytes = _max_bytes()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        with _answers("batch", batch_id):
            raise too_large(max_bytes, int(declared))
    platform = _platform()
    owner = await run_in_threadpool(_upload_owner, platform, _checked("batch", batch_id), caller)
    item = pipeline.Upload(name, stream=cast(IO[bytes], body))
    store = functools.partial(pipeline.upload, platform, owner, item, batch_id=batch_id)
    with _answers("batch", batch_id):
        file_id = await anyio.to_thread.run_sync(store, limiter=_uploads(request))
    row = await run_in_threadpool(_file_row, platform, file_id)
    return UploadedFile(**{k: row[k] for k in UploadedFile.model_fields})


def _file_row(platform: Platform, file_id: str) -> RowMapping:
    with platform.engine.connect() as conn:
        row = flow.get_file(conn, file_id)
    if row is None:  # cancelled and swept in between: as good as gone
        raise _not_found("file", file_id)
    return row


@router.post(
    "/files/{file_id}/confirm",
    response_model=ConfirmedFile,
    operation_id="confirmFile",
    summary="Confirm an uploaded file: process it",
    description="Scope `submit`. Moves the file `uploaded → queued` and submits its "
    "extract → chunk → embed chain, in one transaction. Idempotent: a file confirmed before "
    "answers `confirmed: false` and nothing runs twice.",
    responses=responses(*AUTH, 404, 503),
)
def confirm_file(caller: Submitter, file_id: FileId) -> ConfirmedFile:
    """Queue the file's processing (once)."""
    platform = _platform()
    with _answers("file", file_id):
        confirmed = pipeline.confirm(platform, _checked("file", file_id), owner=_owner(caller))
    return ConfirmedFile(id=file_id, confirmed=confirmed, status=_file_row(platform, file_id)["status"])


@router.post(
    "/batches/{batch_id}/seal",
    response_model=Batch,
    operation_id="sealBatch",
    summary="Seal a batch: no more files",
    description="Scope `submit`. The batch completes once every file in it is terminal (at once "
    "if they all are). Idempotent. Returns the batch as it is now.",
    responses=responses(*AUTH, 404, 503),
)
def seal_batch(caller: Submitter, batch_id: BatchId) -> Batch:
    """Seal the batch."""
    with _answers("batch", batch_id):
        row = pipeline.seal_batch(_platform(), _checked("batch", batch_id), owner=_owner(caller))
    return Batch.from_row(row)


@router.post(
    "/batches/{batch_id}/cancel",
    response_model=CancelledBatch,
    operation_id="cancelBatch",
    summary="Cancel a batch",
    description="Scope `submit`. Seals the batch and cancels its files that have not finished "
    "(cancelled counts as terminal, so it completes). Idempotent.",
    responses=responses(*AUTH, 404, 503),
)
def cancel_batch(caller: Submitter, batch_id: BatchId) -> CancelledBatch:
    """Cancel the batch's unfinished files, recording the caller's token as who did."""
    platform = _platform()
    with _answers("batch", batch_id):
        n = pipeline.cancel_batch(platform, _checked("batch", batch_id), by=caller.name, owner=_owner(caller))
        return CancelledBatch(cancelled=n, batch=_batch(platform, batch_id, None))


@router.post(
    "/batches/{batch_id}/retry-failed",
    response_model=RetriedFiles,
    operation_id="retryFailedFiles",
    summary="Retry a batch's failed files",
    description="Scope `submit`. Each failed file runs again from the stage it failed in (its "
    "dead letter is retried); the batch's new totals come as `batch.summary_changed`. Files "
    "refused at upload have nothing to retry: upload them again.",
    responses=responses(*AUTH, 404, 409, 503),
)
def retry_failed(caller: Submitter, batch_id: BatchId) -> RetriedFiles:
    """Retry the batch's failed files from the dead-letter queue."""
    with _answers("batch", batch_id):
        ids = pipeline.retry_failed(
            _platform(), _checked("batch", batch_id), by=caller.name, owner=_owner(caller)
        )
    return RetriedFiles(retried=len(ids), job_ids=ids)


__all__ = ["router"]
