"""Content by reference: payloads carry a reference string, the bytes live in storage.

References are ``file://<key>`` (a :class:`LocalStorage` under a root directory) or
``s3://<bucket>/<key>`` (:class:`S3Storage`). A key is a relative, ``/``-separated path with no
empty, ``.`` or ``..`` segment, so a reference can never point outside its root.

Errors, on the platform's retry policy:

- :class:`~tasks.files.errors.ContentMissing` (permanent): the referenced object does not exist
  (``get``; ``exists`` returns False instead, ``delete`` of a missing object is a no-op).
- :class:`~tasks.files.errors.StorageUnavailable` (transient, retried with backoff): the backend
  could not be reached or timed out, answered 5xx, or throttled (429, ``SlowDown``,
  ``RequestTimeout``...), or a local I/O error other than the ones below.
- :class:`StorageRejected` (permanent): the backend refused the request with a 4xx other than
  404 (403 access denied, 400 bad request...), credentials are missing, or the bucket does not
  exist on ``put``. Retrying cannot fix these; they need an operator, then a replay.
- :class:`InvalidReference` (permanent, also a ``ValueError``): a key or reference that escapes
  the root, has an unknown scheme, or names a bucket this storage does not serve.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from tasks.files.errors import (
    ContentMissing,
    FileRejected,
    FileTooLarge,
    StorageUnavailable,
    UploadInterrupted,
)

if TYPE_CHECKING:
    from config.settings import Settings

__all__ = [
    "InvalidReference",
    "LocalStorage",
    "S3Settings",
    "S3Storage",
    "Storage",
    "StorageRejected",
    "Stored",
    "files_storage",
    "new_storage",
    "storage_for",
    "too_large",
]

FILE_SCHEME = "file://"
OCTET_STREAM = "application/octet-stream"
S3_SCHEME = "s3://"

# Error codes that S3 and S3-compatible stores use for "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "NoSuchBucket", "404"})


class StorageRejected(FileRejected):
    """The storage backend refused the request (4xx other than 404, no credentials)."""


class InvalidReference(FileRejected, ValueError):
    """A key or reference that this storage cannot serve (bad scheme, escapes the root...)."""


_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Stored:
    """What :meth:`Storage.put_stream` wrote: the reference, the size and the SHA-256."""

    ref: str
    size: int
    checksum: str


def spool(source: IO[bytes], directory: Path | None, max_bytes: int) -> tuple[Path, int, str]:
    """Copy ``source`` into a temporary file, 1 MiB at a time; returns (path, size, sha256).

    Refuses (:class:`FileTooLarge`) as soon as more than ``max_bytes`` arrived, without
    reading the rest: memory stays at one buffer whatever the upload's size.
    """
    digest = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".upload.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            while block := _read(source):
                size += len(block)
                if size > max_bytes:
                    raise too_large(max_bytes)
                digest.update(block)
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp), size, digest.hexdigest()


def _read(source: IO[bytes]) -> bytes:
    try:
        block = source.read(_CHUNK)
    except OSError as exc:  # the source's fault, not the storage's
        raise UploadInterrupted(f"the upload stopped before its end: {exc}") from exc
    if not isinstance(block, bytes):
        kind = type(block).__name__
        raise TypeError(f"an upload's stream must be binary (open files with 'rb'), got {kind}")
    return block


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:.1f}".removesuffix(".0") + " MiB"


def too_large(max_bytes: int, size: int | None = None) -> FileTooLarge:
    """The error for content over ``max_bytes`` (its size, when known)."""
    if size is None:
        return FileTooLarge(f"file is over the {_mib(max_bytes)} limit")
    return FileTooLarge(f"file is {_mib(size)}, over the {_mib(max_bytes)} limit")


class Storage(Protocol):
    """Where file content lives; references are opaque strings to everyone else."""

    def ref_for(self, key: str) -> str:
        """The reference that ``put(key, ...)`` returns."""
        ...

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key`` (replacing any previous content) and return its reference."""
        ...

    def put_bytes(self, key: str, data: bytes, content_type: str = OCTET_STREAM) -> str:
        """As :meth:`put`, with the content's media type (kept where the backend has one: S3)."""
        ...

    def put_stream(self, key: str, source: IO[bytes], max_bytes: int) -> Stored:
        """Stream ``source`` to ``key`` without buffering it; :class:`FileTooLarge` past ``max_bytes``
        (and then nothing is stored)."""
        ...

    def size(self, ref: str) -> int:
        """The stored size of ``ref`` in bytes, without reading it."""
        ...

    def local_path(self, ref: str) -> AbstractContextManager[Path]:
        """A local file holding the content of ``ref`` for the duration of the block."""
        ...

    def get(self, ref: str) -> bytes:
        """The content behind ``ref``; :class:`ContentMissing` if there is none."""
        ...

    def exists(self, ref: str) -> bool:
        """Whether ``ref`` has content."""
        ...

    def delete(self, ref: str) -> None:
        """Remove the content behind ``ref``; removing missing content is a no-op."""
        ...


def _check_key(key: str) -> str:
    if not key or "\x00" in key or "\\" in key:
        raise InvalidReference(f"invalid storage key {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        # Catches absolute keys ("/x" has an empty first segment) and traversal ("a/../../x").
        raise InvalidReference(f"storage key must be a relative path without '.', '..' or '//': {key!r}")
    return key


class LocalStorage:
    """Content as files under ``root``; references are ``file://<key>``.

    Writes are atomic (a temporary file in the target directory, fsynced, then ``os.replace``):
    a reader sees the old content or the new, never a partial file.
    """

    def __init__(self, root: Path) -> None:
        """Serve files under ``root`` (created on the first ``put``)."""
        self.root = Path(root).expanduser().resolve()

    def ref_for(self, key: str) -> str:
        """The reference that ``put(key, ...)`` returns."""
        return FILE_SCHEME + _check_key(key)

    def _path(self, ref: str) -> Path:
        if not ref.startswith(FILE_SCHEME):
            raise InvalidReference(f"not a file:// reference: {ref!r}")
        return self._path_for_key(ref[len(FILE_SCHEME) :])

    def _path_for_key(self, key: str) -> Path:
        path = (self.root / _check_key(key)).resolve()
        # A symlink inside the root could still lead out of it.
        if not path.is_relative_to(self.root):
            raise InvalidReference(f"storage key escapes the root: {key!r}")
        return path

    def put(self, key: str, data: bytes) -> str:
        """Write ``data`` atomically to ``root/key`` and return ``file://<key>``."""
        return self.put_stream(key, io.BytesIO(data), max_bytes=len(data)).ref

    def put_bytes(self, key: str, data: bytes, content_type: str = OCTET_STREAM) -> str:
        """:meth:`put`; a local file has no media type, so ``content_type`` is not kept."""
        return self.put(key, data)

    def put_stream(self, key: str, source: IO[bytes], max_bytes: int) -> Stored:
        """Stream ``source`` into ``root/key`` (atomically, as :meth:`put`)."""
        path = self._path_for_key(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp, size, checksum = spool(source, path.parent, max_bytes)
            try:
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self._fsync_dir(path.parent)
        except PermissionError as exc:
            raise StorageRejected(f"storage refused put {key!r}: {exc}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"storage unavailable (put {key!r}): {exc}") from exc
        return Stored(FILE_SCHEME + key, size, checksum)

    def size(self, ref: str) -> int:
        """The file's size from ``stat``."""
        try:
            return self._path(ref).stat().st_size
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ContentMissing(f"content not found: {ref}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"storage unavailable (stat {ref}): {exc}") from exc

    @contextmanager
    def local_path(self, ref: str) -> Iterator[Path]:
        """The file itself: nothing is copied."""
        path = self._path(ref)
        if not path.exists() or path.is_dir():
            raise ContentMissing(f"content not found: {ref}")
        yield path

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        # Makes the rename itself durable; not every platform can open a directory.
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def get(self, ref: str) -> bytes:
        """The content behind ``ref``."""
        path = self._path(ref)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ContentMissing(f"content not found: {ref}") from exc
        except PermissionError as exc:
            raise StorageRejected(f"storage refused get {ref}: {exc}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"storage unavailable (get {ref}): {exc}") from exc

    def exists(self, ref: str) -> bool:
        """Whether ``ref`` names an existing file."""
        return self._path(ref).is_file()

    def delete(self, ref: str) -> None:
        """Remove the file behind ``ref`` if it exists, with the partial writes of an upload
        that died beside it (its temporary files), and its directory once empty."""
        path = self._path(ref)
        try:
            path.unlink(missing_ok=True)
            if path.parent.is_dir():
                for partial in path.parent.glob(".*.tmp"):
                    partial.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # only when empty
        except PermissionError as exc:
            raise StorageRejected(f"storage refused delete {ref}: {exc}") from exc
        except OSError as exc:
            raise StorageUnavailable(f"storage unavailable (delete {ref}): {exc}") from exc


class S3Settings(BaseModel):
    """Where and how to reach an S3-compatible store (AWS S3, MinIO, Ceph...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str
    endpoint_url: str | None = Field(None, description="for S3-compatible stores; None means AWS")
    region: str = "us-east-1"
    access_key: str | None = Field(None, description="None: boto3's own credential chain (e.g. an IAM role)")
    secret_key: str | None = Field(None, repr=False)
    connect_timeout: float = 3.0
    read_timeout: float = 10.0
    max_attempts: int = Field(3, ge=1, description="botocore attempts per call, the first included")
    addressing_style: Literal["auto", "path", "virtual"] = "auto"


class S3Storage:
    """Content as objects in one S3 bucket; references are ``s3://<bucket>/<key>``.

    Timeouts and botocore's own retries are kept small on purpose: a long outage is the
    platform's job (the stage is retried with backoff on :class:`StorageUnavailable`), and a
    worker must not sit in a retry loop for minutes.
    """

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        addressing_style: Literal["auto", "path", "virtual"] = "auto",
    ) -> None:
        """Build the boto3 client from explicit arguments only.

        With ``access_key``/``secret_key`` None, boto3 falls back to its own credential chain.
        """
        import boto3
        from botocore.config import Config

        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        self.bucket = bucket
        config = Config(
            region_name=region,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": addressing_style},
            # Only the arguments configure the endpoint, never AWS_ENDPOINT_URL* or ~/.aws/config.
            ignore_configured_endpoint_urls=True,
        )
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )

    @classmethod
    def from_settings(cls, settings: S3Settings) -> S3Storage:
        """An S3Storage configured by ``settings``."""
        return cls(
            settings.bucket,
            endpoint_url=settings.endpoint_url,
            region=settings.region,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            max_attempts=settings.max_attempts,
            addressing_style=settings.addressing_style,
        )

    def ref_for(self, key: str) -> str:
        """The reference that ``put(key, ...)`` returns."""
        return f"{S3_SCHEME}{self.bucket}/{_check_key(key)}"

    def _key(self, ref: str) -> str:
        prefix = f"{S3_SCHEME}{self.bucket}/"
        if not ref.startswith(prefix):
            raise InvalidReference(f"not a reference into s3://{self.bucket}/: {ref!r}")
        return _check_key(ref[len(prefix) :])

    def put(self, key: str, data: bytes) -> str:
        """Upload ``data`` as ``key`` and return ``s3://<bucket>/<key>``."""
        return self.put_bytes(key, data)

    def put_bytes(self, key: str, data: bytes, content_type: str = OCTET_STREAM) -> str:
        """Upload ``data`` as ``key`` with ``Content-Type: content_type``; ``s3://<bucket>/<key>``."""
        ref = self.ref_for(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentType=content_type)
        except Exception as exc:
            error = _translate(exc, "put", ref, missing=StorageRejected)
            if error is None:
                raise
            raise error from exc
        return ref

    def put_stream(self, key: str, source: IO[bytes], max_bytes: int) -> Stored:
        """Spool ``source`` to a local temporary file (bounded by ``max_bytes``), then upload it
        (multipart for large files): an oversized upload never reaches the bucket."""
        ref = self.ref_for(key)
        tmp, size, checksum = spool(source, None, max_bytes)
        try:
            self._client.upload_file(str(tmp), self.bucket, key)
        except Exception as exc:
            error = _translate(exc, "put", ref, missing=StorageRejected)
            if error is None:
                raise
            raise error from exc
        finally:
            tmp.unlink(missing_ok=True)
        return Stored(ref, size, checksum)

    def size(self, ref: str) -> int:
        """``ContentLength`` from a HEAD request."""
        key = self._key(ref)
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except Exception as exc:
            error = _translate(exc, "size", ref, missing=ContentMissing)
            if error is None:
                raise
            raise error from exc

    @contextmanager
    def local_path(self, ref: str) -> Iterator[Path]:
        """The object downloaded (streamed) into a temporary file, removed afterwards."""
        key = self._key(ref)
        fd, tmp = tempfile.mkstemp(prefix=".download.", suffix=".tmp")
        os.close(fd)
        try:
            try:
                self._client.download_file(self.bucket, key, tmp)
            except Exception as exc:
                error = _translate(exc, "get", ref, missing=ContentMissing)
                if error is None:
                    raise
                raise error from exc
            yield Path(tmp)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def get(self, ref: str) -> bytes:
        """Download the object behind ``ref``."""
        key = self._key(ref)
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
        except Exception as exc:
            error = _translate(exc, "get", ref, missing=ContentMissing)
            if error is None:
                raise
            raise error from exc
        return data

    def exists(self, ref: str) -> bool:
        """Whether the object behind ``ref`` exists.

        Without ``s3:ListBucket`` permission S3 answers 403 for a missing key, which raises
        :class:`StorageRejected` here rather than guessing.
        """
        key = self._key(ref)
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            error = _translate(exc, "exists", ref, missing=ContentMissing)
            if error is None:
                raise
            if isinstance(error, ContentMissing):
                return False
            raise error from exc
        return True

    def delete(self, ref: str) -> None:
        """Delete the object behind ``ref`` (S3 deletes are idempotent)."""
        key = self._key(ref)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            error = _translate(exc, "delete", ref, missing=ContentMissing)
            if error is None:
                raise
            if isinstance(error, ContentMissing):
                return
            raise error from exc


def _translate(exc: Exception, op: str, ref: str, *, missing: type[FileRejected]) -> Exception | None:
    """Map a boto3/botocore failure onto the files error tree; None for errors left as they are.

    Unclassified failures propagate unchanged, which the platform retries by default.
    """
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        ParamValidationError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return StorageUnavailable(f"storage unavailable ({op} {ref}): {code or status}")
        if status == 404 or code in _MISSING_CODES:
            if missing is ContentMissing:
                return ContentMissing(f"content not found: {ref}")
            return missing(f"storage refused {op} {ref}: {code or status}")
        return StorageRejected(f"storage refused {op} {ref}: {code or 'error'} (HTTP {status})")
    if isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError):
        # Covers EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError.
        return StorageUnavailable(f"storage unavailable ({op} {ref}): {exc}")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | ParamValidationError):
        return StorageRejected(f"storage refused {op} {ref}: {exc}")
    return None


@lru_cache(maxsize=8)
def _s3_storage(settings: S3Settings) -> S3Storage:
    # boto3 clients are thread-safe and costly to build (~tens of ms): one per settings.
    return S3Storage.from_settings(settings)


def storage_for(ref: str, *, local_root: Path, s3: S3Settings | None) -> Storage:
    """The storage that serves ``ref``, chosen by its scheme.

    Raises:
        InvalidReference: unknown scheme, or an ``s3://`` reference with no S3 configured.
    """
    if ref.startswith(FILE_SCHEME):
        return LocalStorage(local_root)
    if ref.startswith(S3_SCHEME):
        if s3 is None:
            raise InvalidReference(f"no S3 storage is configured for {ref!r}")
        return _s3_storage(s3)
    raise InvalidReference(f"unsupported storage reference {ref!r} (expected file:// or s3://)")


def new_storage(s3: S3Settings | None, local_dir: Path) -> Storage:
    """Where new content is written: the bucket of ``s3`` when it is set, else ``local_dir``.

    Each family passes its own choice (the files family: :func:`files_storage`). The S3
    client is shared per settings, as :func:`storage_for` shares it.
    """
    if s3 is not None:
        return _s3_storage(s3)
    return LocalStorage(local_dir)


def files_storage(settings: Settings) -> Storage:
    """Where the files family writes new uploads (``CONVEYOR_FILES``: ``s3``, else ``storage_dir``)."""
    return new_storage(settings.files.s3, settings.files_storage_dir())
