"""The files family's batches: pure canvas builders, and the functions apps call to
upload files and follow, seal, cancel and retry their batches.

The seed's flow: ``new_batch`` (optionally with its expected count) → ``upload`` per
file (content streamed to storage by reference) → ``confirm`` per file, which moves it
``uploaded → queued`` and submits its chain in the same transaction (published only after
commit, so a confirmed file can never be left behind, and confirming twice launches one
flow) → ``seal_batch`` (or the last expected upload seals it). A sealed batch completes,
exactly once, when its last counted file is terminal, whichever comes last.
``process_batch`` does all of it for a list of files, with one chord whose body only asks
the database whether the batch is complete. Search and re-embedding:
:mod:`pipelines.files.retrieval`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import unicodedata
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from celery import Signature, chain, chord, group
from sqlalchemy import Connection, insert, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.orm import Session

from conveyor.errors import PayloadInvalid
from conveyor.platform import Platform
from conveyor.store.db.dialect import db_now
from conveyor.store.db.schema import dead_letters, jobs
from conveyor.store.jobs import new_event
from tasks.files import flow
from tasks.files.errors import FileRejected
from tasks.files.flow import BatchClosed
from tasks.files.models import (
    ACTIVE,
    CANCELLED,
    FAILED,
    QUEUED,
    UPLOADED,
    UPLOADING,
    batches,
    files,
)
from tasks.files.storage import Storage, files_storage, too_large

log = logging.getLogger("conveyor.files")

__all__ = [
    "BatchClosed",
    "Upload",
    "batch_status",
    "cancel_batch",
    "confirm",
    "new_batch",
    "process_batch",
    "replace_content",
    "retry_failed",
    "seal_batch",
    "upload",
]


def file_chain(file_id: str, name: str | None = None) -> Signature:
    """extract → chunk → embed for one file (each later stage gets the previous result)."""
    from tasks.files.stages import chunk_stage, embed_stage, extract_stage

    return chain(extract_stage.si(file_id=file_id, name=name), chunk_stage.s(), embed_stage.s())


def batch_chord(batch_id: str, named: Sequence[tuple[str, str]]) -> Signature:
    """Every file's chain as a chord header; the body asks Postgres to complete the batch.

    The body is immutable (``si``): it needs only the batch id, and the header's results
    (one per file) would make its payload grow with the batch past ``max_payload_bytes``.
    """
    from tasks.files.stages import complete_batch

    return chord(group(file_chain(f, n) for f, n in named), complete_batch.si(batch_id=batch_id))


@dataclass(frozen=True)
class Upload:
    """A file to upload: its name and its content, as bytes, a path or a binary stream.

    A path or a stream is copied to storage 1 MiB at a time, never read whole into memory
    (``Upload.from_path``; a web framework's upload object as ``stream``).
    """

    name: str
    data: bytes | None = None
    path: Path | None = None
    stream: IO[bytes] | None = None

    @classmethod
    def from_path(cls, path: str | Path, name: str | None = None) -> Upload:
        """The file at ``path``, streamed at upload time."""
        path = Path(path)
        return cls(name or path.name, path=path)

    def known_size(self) -> int | None:
        """The size, when it is known without reading the content."""
        if self.data is not None:
            return len(self.data)
        if self.path is not None:
            return self.path.stat().st_size
        return None

    def open(self) -> AbstractContextManager[IO[bytes]]:
        """The content as a binary stream."""
        if self.path is not None:
            return self.path.open("rb")
        if self.stream is not None:
            return nullcontext(self.stream)
        return nullcontext(io.BytesIO(self.data or b""))


def _new_storage() -> Storage:
    """Where new uploads go (:func:`tasks.files.storage.files_storage` of this platform's
    settings); one name to replace in tests that take the storage down."""
    from tasks.files.stages import _settings

    return files_storage(_settings())


def _safe_segment(text: str, fallback: str) -> str:
    """A storage key segment: no separators, no dot-only names."""
    cleaned = re.sub(r"[^\w.\-]+", "_", text).strip("._")
    return cleaned or fallback


_SEGMENT = 100  # characters: far below a file system's 255-byte name limit


def _short(segment: str) -> str:
    """At most ``_SEGMENT`` characters, keeping a short extension."""
    if len(segment) <= _SEGMENT:
        return segment
    suffix = Path(segment).suffix[:12]
    return segment[: _SEGMENT - len(suffix)] + suffix


def _storage_key(owner: str, file_id: str, name: str) -> str:
    """Where a file's content lives: ``<owner>/<file id>/<file name>`` (each segment
    bounded; the file id alone makes the key unique)."""
    owner_part = _short(_safe_segment(owner, "owner"))
    return f"{owner_part}/{file_id}/{_short(_safe_segment(Path(name).name, 'file'))}"


OWNER_MAX = 200  # files.owner and file_batches.owner are String(200)


def check_owner(owner: str) -> str:
    """``owner`` if it can own files: a str of 1 to ``OWNER_MAX`` characters, not blank.

    Raises:
        PayloadInvalid: otherwise (Postgres would refuse a longer one mid-upload, SQLite
            would keep it: both databases must agree).
    """
    if not isinstance(owner, str) or not owner.strip() or len(owner) > OWNER_MAX:
        shown = f"{len(owner)} characters" if isinstance(owner, str) else type(owner).__name__
        raise PayloadInvalid(f"an owner is 1 to {OWNER_MAX} characters, not blank; got {shown}")
    return owner


def new_batch(platform: Platform, owner: str, *, expected: int | None = None) -> str:
    """An open batch. With ``expected``, the upload of the last expected file seals it;
    without, call :func:`seal_batch` once every file is uploaded (either way it completes
    once sealed and every counted file is terminal)."""
    check_owner(owner)
    if expected is not None and expected < 0:
        raise ValueError(f"expected must be 0 or more, got {expected}")
    batch_id = str(uuid.uuid4())
    with Session(platform.engine) as session:
        session.connection().execute(
            insert(batches).values(
                id=batch_id,
                owner=owner,
                sealed=expected == 0,
                expected=expected,
                total=0,
                terminal=0,
                ready=0,
                failed=0,
                cancelled=0,
                status="processing" if expected == 0 else "open",
                created_at=db_now(),
            )
        )
        if expected == 0:  # nothing to wait for
            flow.try_complete(session.connection(), batch_id, _emit(platform, session))
        session.commit()
    return batch_id


def _display_name(name: str) -> str:
    """The name people see: its last path segment, valid text without control characters.

    A name read from a file system that is not UTF-8 carries lone surrogates; they become
    the characters they stood for when those bytes are UTF-8, else U+FFFD.
    """
    base = Path(name).name
    try:
        base = base.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        base = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in base)
    base = "".join(c for c in base if unicodedata.category(c) != "Cc").strip()
    return base[:500] or "file"


def upload(platform: Platform, owner: str, item: Upload, *, batch_id: str | None = None) -> str:
    """Store the content and record the file ``uploaded`` (counted in its batch); returns its id.

    The row is written first (``uploading``), then the content streamed to storage, then
    the row completed: a failed upload removes its object and its row, and one killed
    half way leaves an ``uploading`` row that the reconciler sweeps with its object, so no
    orphan object survives. Anything over ``max_bytes`` is refused (:class:`FileTooLarge`)
    before it is read, when its size is known, else as soon as that much has arrived; an
    owner that cannot own files is :class:`PayloadInvalid` (see :func:`check_owner`).
    Raises :class:`LookupError` for an unknown batch (or one of another owner) and
    :class:`BatchClosed` for a sealed or full one.
    """
    from tasks.files.stages import _settings

    check_owner(owner)
    max_bytes = _settings().files.max_bytes
    size = item.known_size()
    if size is not None and size > max_bytes:
        raise too_large(max_bytes, size)
    file_id = str(uuid.uuid4())
    name = _display_name(item.name)
    store = _new_storage()
    key = _storage_key(owner, file_id, name)
    ref = store.ref_for(key)
    with platform.engine.begin() as conn:
        if batch_id is not None:
            _check_open(conn, batch_id, owner)
        conn.execute(
            insert(files).values(
                id=file_id,
                owner=owner,
                batch_id=batch_id,
                name=name,
                size=0,
                content_ref=ref,
                checksum="",
                status=UPLOADING,
                created_at=db_now(),
                updated_at=db_now(),
            )
        )
    try:
        with item.open() as source:
            stored = store.put_stream(key, source, max_bytes)
        with Session(platform.engine) as session:
            conn = session.connection()
            if batch_id is not None:
                flow.count_upload(conn, batch_id, _emit(platform, session))
            conn.execute(
                files.update()
                .where(files.c.id == file_id, files.c.status == UPLOADING)
                .values(
                    status=UPLOADED,
                    content_ref=stored.ref,
                    size=stored.size,
                    checksum=stored.checksum,
                    updated_at=db_now(),
                )
            )
            session.commit()
    except BaseException:
        _discard(file_id, ref)
        raise
    return file_id


def _check_open(conn: Connection, batch_id: str, owner: str) -> None:
    if _batch_of(conn, batch_id, owner)["sealed"]:
        raise BatchClosed(f"batch {batch_id} is sealed: it takes no more files")


def _discard(file_id: str, ref: str) -> None:
    """Undo a failed upload (the reconciler retries what fails here)."""
    from tasks.files.stages import discard_upload

    try:
        discard_upload(file_id, ref)
    except Exception:
        log.warning("could not discard failed upload %s; the reconciler will", file_id, exc_info=True)


def _emit(platform: Platform, session: Session) -> flow.Emit:
    return lambda topic, body: platform.store.emit(session.connection(), [new_event(None, topic, dict(body))])


def confirm(platform: Platform, file_id: str, *, owner: str | None = None) -> bool:
    """``uploaded → queued`` and submit its chain, in one transaction. False if already confirmed.

    Raises :class:`LookupError` for an unknown file (or one of another owner).
    """
    with Session(platform.engine) as session:
        conn = session.connection()
        row = flow.get_file(conn, file_id)
        if row is None or (owner is not None and row["owner"] != owner) or row["status"] == UPLOADING:
            raise LookupError(f"file {file_id} not found")
        before = flow.transition(conn, file_id, [UPLOADED], QUEUED, _emit(platform, session))
        if before is None:
            return False
        with platform.enlisted(session):
            file_chain(file_id, before["name"]).apply_async()
        session.commit()
    return True


def seal_batch(platform: Platform, batch_id: str, *, owner: str | None = None) -> dict[str, Any]:
    """No more files: the batch completes once every counted file is terminal, at once if
    they all are. Idempotent. Returns the batch; :class:`LookupError` if there is none (of
    ``owner``, when given)."""
    with Session(platform.engine) as session:
        row = flow.seal(session.connection(), batch_id, _emit(platform, session), owner=owner)
        session.commit()
    if row is None:
        raise LookupError(f"batch {batch_id} not found")
    return dict(row)


def process_batch(platform: Platform, owner: str, items: Sequence[Upload]) -> str:
    """Upload every file, seal the batch, queue the files and apply one chord, atomically.

    A file refused at upload (too large) is recorded ``failed`` in the batch with its
    reason, and the others go on.
    """
    batch_id = new_batch(platform, owner)
    named: list[tuple[str, str]] = []
    try:
        for item in items:
            try:
                named.append((upload(platform, owner, item, batch_id=batch_id), _display_name(item.name)))
            except FileRejected as exc:
                _record_refused(platform, batch_id, owner, item.name, exc)
        with Session(platform.engine) as session:
            conn = session.connection()
            emit = _emit(platform, session)
            for file_id, _ in named:
                flow.transition(conn, file_id, [UPLOADED], QUEUED, emit)
            flow.seal(conn, batch_id, emit)  # an empty batch completes at once
            if named:
                with platform.enlisted(session):
                    batch_chord(batch_id, named).apply_async()
            session.commit()
    except BaseException:
        # Storage or the database failed half way: the half-filled batch is closed
        # (cancelled, so it completes) rather than left open forever; the caller retries.
        with contextlib.suppress(Exception):
            cancel_batch(platform, batch_id, by="a failed submit")
        raise
    return batch_id


def _record_refused(platform: Platform, batch_id: str, owner: str, name: str, error: Exception) -> None:
    """A file refused at upload: a ``failed`` row, counted in its batch (no job ran)."""
    file_id = str(uuid.uuid4())
    with Session(platform.engine) as session:
        conn = session.connection()
        flow.count_upload(conn, batch_id, _emit(platform, session))
        conn.execute(
            insert(files).values(
                id=file_id,
                owner=owner,
                batch_id=batch_id,
                name=_display_name(name),
                size=0,
                content_ref="",
                checksum="",
                status=UPLOADED,
                created_at=db_now(),
                updated_at=db_now(),
            )
        )
        flow.transition(
            conn,
            file_id,
            [UPLOADED],
            FAILED,
            _emit(platform, session),
            error=str(error)[:500],
            error_type=type(error).__name__,
            failed_stage="upload",
        )
        session.commit()


def _batch_of(conn: Connection, batch_id: str, owner: str | None) -> RowMapping:
    row = flow.batch_summary(conn, batch_id)
    if row is None or (owner is not None and row["owner"] != owner):
        raise LookupError(f"batch {batch_id} not found")
    return row


def cancel_batch(platform: Platform, batch_id: str, *, by: str = "api", owner: str | None = None) -> int:
    """Seal the batch and cancel its non-terminal files (cancelled counts as terminal), so
    it completes; returns how many files were cancelled. Only ``owner``'s, when given."""
    with Session(platform.engine) as session:
        _batch_of(session.connection(), batch_id, owner)
        flow.seal(session.connection(), batch_id, _emit(platform, session))
        session.commit()
    with platform.engine.connect() as conn:
        open_files = (
            conn.execute(
                select(files.c.id).where(
                    files.c.batch_id == batch_id, files.c.status.in_([UPLOADED, *ACTIVE])
                )
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
                [UPLOADED, *ACTIVE],
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
        if _new_storage().put(key, data) != row["content_ref"]:
            raise ValueError(f"file {file_id} is stored elsewhere; upload it again instead")
        conn.execute(
            files.update()
            .where(files.c.id == file_id)
            .values(size=len(data), checksum=hashlib.sha256(data).hexdigest(), updated_at=db_now())
        )


def retry_failed(
    platform: Platform, batch_id: str, *, by: str = "api", owner: str | None = None
) -> list[str]:
    """Retry the batch's failed files from the DLQ, each from the stage it failed in.

    Only this batch's dead letters are read (never other users'). Returns the retried job
    ids. The batch stays completed if it was; its new totals come as
    ``batch.summary_changed``. Files refused at upload have no job to retry: upload them again.
    """
    with platform.engine.connect() as conn:
        _batch_of(conn, batch_id, owner)
        failed = (
            conn.execute(select(files.c.id).where(files.c.batch_id == batch_id, files.c.status == FAILED))
            .scalars()
            .all()
        )
        entries = (
            conn.execute(
                select(dead_letters.c.id)
                .join(jobs, jobs.c.id == dead_letters.c.job_id)
                .where(
                    dead_letters.c.retried_at.is_(None),
                    dead_letters.c.stage.like("conveyor.files.%"),
                    jobs.c.payload["file_id"].as_string().in_(list(failed)),
                )
            )
            .scalars()
            .all()
            if failed
            else []
        )
    retried = []
    for entry_id in entries:
        job_id = platform.dlq.retry(int(entry_id), by=by)
        if job_id is not None:
            retried.append(job_id)
    return retried


def batch_status(platform: Platform, batch_id: str, *, owner: str | None = None) -> dict[str, Any]:
    """The batch's counters and its files' states (only ``owner``'s batch, when given)."""
    with platform.engine.connect() as conn:
        summary = _batch_of(conn, batch_id, owner)
        states = conn.execute(
            select(files.c.id, files.c.name, files.c.status, files.c.error, files.c.error_type)
            .where(files.c.batch_id == batch_id, files.c.status != UPLOADING)
            .order_by(files.c.created_at, files.c.id)
        ).all()
    return {"batch": dict(summary), "files": [dict(r._mapping) for r in states]}
