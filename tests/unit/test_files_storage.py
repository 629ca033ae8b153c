"""Content storage: local files, and S3 against moto's server and small misbehaving HTTP servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tasks.files.errors import ContentMissing, FileRejected, StorageUnavailable
from tasks.files.storage import (
    InvalidReference,
    LocalStorage,
    S3Settings,
    S3Storage,
    StorageRejected,
    files_storage,
    new_storage,
    storage_for,
)

BUCKET = "conveyor-test"
DIGEST = "digests/u.1/2024-03-04-2024-03-11.json"
FAKE_KEY = "testing"


def _s3(endpoint: str, bucket: str = BUCKET, **options: Any) -> S3Storage:
    return S3Storage(bucket, endpoint_url=endpoint, access_key=FAKE_KEY, secret_key=FAKE_KEY, **options)


# --- local ------------------------------------------------------------------------------------


def test_local_round_trip(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "content")
    ref = store.put("jobs/abc/report.pdf", b"%PDF-1.7 hello")
    assert ref == "file://jobs/abc/report.pdf"
    assert store.exists(ref)
    assert store.get(ref) == b"%PDF-1.7 hello"
    assert (tmp_path / "content" / "jobs" / "abc" / "report.pdf").read_bytes() == b"%PDF-1.7 hello"
    assert store.put("jobs/abc/report.pdf", b"v2") == ref
    assert store.get(ref) == b"v2"
    assert sorted(p.name for p in (tmp_path / "content" / "jobs" / "abc").iterdir()) == ["report.pdf"]
    store.delete(ref)
    assert not store.exists(ref)
    store.delete(ref)  # idempotent
    with pytest.raises(ContentMissing, match=r"content not found: file://jobs/abc/report\.pdf"):
        store.get(ref)


def test_local_empty_content(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    assert store.get(store.put("empty", b"")) == b""


@pytest.mark.parametrize(
    "key",
    [
        "../outside",
        "a/../../outside",
        "/etc/passwd",
        "",
        "a//b",
        "./a",
        "a/./b",
        "a/..",
        "a\\..\\b",
        "a\x00b",
    ],
)
def test_local_rejects_keys_escaping_the_root(tmp_path: Path, key: str) -> None:
    store = LocalStorage(tmp_path / "root")
    with pytest.raises(InvalidReference):
        store.put(key, b"x")
    with pytest.raises(InvalidReference):
        store.get("file://" + key)
    assert not (tmp_path / "outside").exists()


def test_local_rejects_symlink_out_of_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    store = LocalStorage(root)
    with pytest.raises(InvalidReference):
        store.put("link/x", b"x")
    assert not (tmp_path / "elsewhere" / "x").exists()


def test_invalid_reference_is_permanent_and_a_value_error(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    for ref in ["s3://b/k", "http://x/y", "jobs/abc"]:
        with pytest.raises(InvalidReference) as info:
            store.get(ref)
        assert isinstance(info.value, FileRejected) and isinstance(info.value, ValueError)


def test_new_storage_local_writes_json_under_its_directory(tmp_path: Path) -> None:
    store = new_storage(None, tmp_path / "trading" / "digests")
    assert isinstance(store, LocalStorage) and store.root == (tmp_path / "trading" / "digests").resolve()
    body = b'{"trades": 0}'
    ref = store.put_bytes(DIGEST, body, "application/json")
    assert ref == f"file://{DIGEST}" == store.ref_for(DIGEST)
    assert (tmp_path / "trading" / "digests" / DIGEST).read_bytes() == body
    assert store.put_bytes(DIGEST, b"{}", "application/json") == ref
    assert store.get(ref) == b"{}"
    with pytest.raises(InvalidReference):
        store.put_bytes("digests/../../x.json", b"{}", "application/json")


def test_storage_for_picks_by_scheme(tmp_path: Path) -> None:
    local = storage_for("file://a/b", local_root=tmp_path, s3=None)
    assert isinstance(local, LocalStorage) and local.root == tmp_path.resolve()
    settings = S3Settings(
        bucket=BUCKET, endpoint_url="http://127.0.0.1:9", access_key=FAKE_KEY, secret_key="s"
    )
    s3 = storage_for(f"s3://{BUCKET}/k", local_root=tmp_path, s3=settings)
    assert isinstance(s3, S3Storage) and s3.bucket == BUCKET
    assert storage_for(f"s3://{BUCKET}/other", local_root=tmp_path, s3=settings) is s3
    with pytest.raises(InvalidReference, match="no S3"):
        storage_for(f"s3://{BUCKET}/k", local_root=tmp_path, s3=None)
    with pytest.raises(InvalidReference, match="unsupported"):
        storage_for("ftp://x/y", local_root=tmp_path, s3=settings)
    assert "secret_key" not in repr(settings)  # kept out of logs


# --- S3 against moto --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3(moto_endpoint: str) -> S3Storage:
    return _s3(moto_endpoint, connect_timeout=2, read_timeout=5)


def test_s3_round_trip(s3: S3Storage) -> None:
    data = bytes(range(256)) * 1000
    ref = s3.put("jobs/j1/input.bin", data)
    assert ref == f"s3://{BUCKET}/jobs/j1/input.bin"
    assert s3.exists(ref)
    assert s3.get(ref) == data
    s3.put("jobs/j1/input.bin", b"replaced")
    assert s3.get(ref) == b"replaced"
    s3.delete(ref)
    assert not s3.exists(ref)
    s3.delete(ref)  # idempotent


def test_s3_missing_key(s3: S3Storage) -> None:
    ref = f"s3://{BUCKET}/no/such/key"
    assert not s3.exists(ref)
    with pytest.raises(ContentMissing, match=f"content not found: s3://{BUCKET}/no/such/key"):
        s3.get(ref)


def test_s3_missing_bucket(moto_endpoint: str) -> None:
    store = _s3(moto_endpoint, "no-such-bucket")
    with pytest.raises(StorageRejected, match="NoSuchBucket"):
        store.put("k", b"x")
    with pytest.raises(ContentMissing):
        store.get("s3://no-such-bucket/k")


def test_s3_rejects_foreign_and_bad_refs(s3: S3Storage) -> None:
    for ref in ["s3://other-bucket/k", "file://k", f"s3://{BUCKET}/../k", f"s3://{BUCKET}/"]:
        with pytest.raises(InvalidReference):
            s3.get(ref)
    with pytest.raises(InvalidReference):
        s3.put("/abs", b"x")


def test_s3_from_settings(moto_endpoint: str) -> None:
    settings = S3Settings(bucket=BUCKET, endpoint_url=moto_endpoint, access_key=FAKE_KEY, secret_key=FAKE_KEY)
    store = S3Storage.from_settings(settings)
    ref = store.put("from-settings", b"ok")
    assert store.get(ref) == b"ok"


def test_new_storage_s3_shares_its_client_and_keeps_the_content_type(
    moto_endpoint: str, tmp_path: Path
) -> None:
    settings = S3Settings(bucket=BUCKET, endpoint_url=moto_endpoint, access_key=FAKE_KEY, secret_key=FAKE_KEY)
    store = new_storage(settings, tmp_path / "unused")
    assert isinstance(store, S3Storage) and store.bucket == BUCKET
    assert new_storage(settings, tmp_path) is store
    assert storage_for(f"s3://{BUCKET}/k", local_root=tmp_path, s3=settings) is store
    body = b'{"trades": 0}'
    ref = store.put_bytes(DIGEST, body, "application/json")
    assert ref == f"s3://{BUCKET}/{DIGEST}"
    assert store.get(ref) == body
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id=FAKE_KEY,
        aws_secret_access_key=FAKE_KEY,
    )
    assert client.head_object(Bucket=BUCKET, Key=DIGEST)["ContentType"] == "application/json"
    assert store.put_bytes(DIGEST, b"v2", "application/json") == ref  # replaces
    assert store.get(ref) == b"v2"
    store.put("plain", b"x")
    assert client.head_object(Bucket=BUCKET, Key="plain")["ContentType"] == "application/octet-stream"
    assert not (tmp_path / "unused").exists()


def test_new_storage_s3_down_is_transient(tmp_path: Path) -> None:
    settings = S3Settings(
        bucket=BUCKET,
        endpoint_url=f"http://127.0.0.1:{_closed_port()}",
        access_key=FAKE_KEY,
        secret_key=FAKE_KEY,
        connect_timeout=0.5,
        read_timeout=0.5,
        max_attempts=1,
    )
    with pytest.raises(StorageUnavailable):
        new_storage(settings, tmp_path).put_bytes("digests/u/a.json", b"{}", "application/json")


def test_files_storage_reads_the_files_settings(moto_endpoint: str, tmp_path: Path) -> None:
    from config.settings import FilesSettings, Settings

    local = files_storage(Settings(files=FilesSettings(storage_dir=tmp_path / "uploads")))
    assert isinstance(local, LocalStorage) and local.root == (tmp_path / "uploads").resolve()
    s3 = S3Settings(bucket=BUCKET, endpoint_url=moto_endpoint, access_key=FAKE_KEY, secret_key=FAKE_KEY)
    remote = files_storage(Settings(files=FilesSettings(storage_dir=tmp_path / "uploads", s3=s3)))
    assert isinstance(remote, S3Storage) and remote is new_storage(s3, tmp_path)


# --- S3 faults ----------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_s3_connection_refused_is_transient() -> None:
    store = _s3(f"http://127.0.0.1:{_closed_port()}", connect_timeout=0.5, read_timeout=0.5, max_attempts=1)
    started = time.monotonic()
    for call in (lambda: store.put("k", b"x"), lambda: store.get(f"s3://{BUCKET}/k")):
        with pytest.raises(StorageUnavailable):
            call()
    with pytest.raises(StorageUnavailable):
        store.exists(f"s3://{BUCKET}/k")
    with pytest.raises(StorageUnavailable):
        store.delete(f"s3://{BUCKET}/k")
    assert time.monotonic() - started < 10


def _serve(respond: Callable[[BaseHTTPRequestHandler], None]) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" at once

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            respond(self)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _s3_error(status: int, code: str) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>m</Message></Error>'
        data = body.encode() if handler.command != "HEAD" else b""
        handler.send_response(status)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return respond


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (503, "SlowDown", StorageUnavailable),
        (500, "InternalError", StorageUnavailable),
        (400, "RequestTimeout", StorageUnavailable),
        (429, "TooManyRequests", StorageUnavailable),
        (403, "AccessDenied", StorageRejected),
        (400, "InvalidRequest", StorageRejected),
    ],
)
def test_s3_error_statuses(status: int, code: str, expected: type[Exception]) -> None:
    server, endpoint = _serve(_s3_error(status, code))
    try:
        store = _s3(endpoint, max_attempts=1)
        with pytest.raises(expected):
            store.get(f"s3://{BUCKET}/k")
        with pytest.raises(expected):
            store.put("k", b"x")
        if status != 400:  # a HEAD answer has no body, so a 400's code is unknowable there
            with pytest.raises(expected):
                store.exists(f"s3://{BUCKET}/k")
    finally:
        server.shutdown()
        server.server_close()


def test_s3_read_timeout_is_transient() -> None:
    release = threading.Event()

    def stall(handler: BaseHTTPRequestHandler) -> None:
        release.wait(5)

    server, endpoint = _serve(stall)
    try:
        store = _s3(endpoint, read_timeout=0.3, max_attempts=1)
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            store.get(f"s3://{BUCKET}/k")
        assert time.monotonic() - started < 3
    finally:
        release.set()
        server.shutdown()
        server.server_close()
