"""The files family's batches over HTTP (``pipelines.files.http``, added to the API by
``HTTP_EXTENSIONS``): the seed's flow on a real worker, tokens, scopes and owners on every
endpoint, uploads streamed and refused past ``files.max_bytes`` (declared or chunked,
in process and through ``conveyor serve``), sealed batches, retries, hostile input, SQLite."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

import conveyor
from conveyor.client import registry
from conveyor.web import create_app, tokens
from conveyor.web.server import deployment_routers
from pipelines.files.http import router as files_router
from tasks.files.models import files
from tests.helpers import eventually
from tests.integration.files_support import TOPICS, file_row
from tests.integration.http_support import Token, auth, problem, serving, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("read", "submit")
LIMIT = 256 * 1024  # files.max_bytes for the size tests


@pytest.fixture(scope="module")
def app(client: conveyor.Client) -> FastAPI:
    """The API as `conveyor serve` builds it: with the deployment's routers."""
    routers = deployment_routers()
    assert files_router in routers
    return create_app(client, routers=routers)


@pytest.fixture(scope="module")
def http(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def small_limit(platform: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(platform.settings.files, "max_bytes", LIMIT)
    return LIMIT


def new_batch(http: TestClient, secret: str, **body: Any) -> dict[str, Any]:
    resp = http.post("/batches", json=body, headers=auth(secret))
    assert resp.status_code == 201, resp.text
    made: dict[str, Any] = resp.json()
    assert resp.headers["Location"] == f"/batches/{made['id']}"
    return made


def send(http: TestClient, secret: str, batch_id: str, name: str, content: Any) -> httpx.Response:
    return http.post(
        f"/batches/{batch_id}/files", params={"name": name}, content=content, headers=auth(secret)
    )


def put(http: TestClient, secret: str, batch_id: str, topic: str) -> dict[str, Any]:
    resp = send(http, secret, batch_id, f"{topic}.txt", TOPICS[topic].encode())
    assert resp.status_code == 201, resp.text
    made: dict[str, Any] = resp.json()
    return made


def shown(http: TestClient, secret: str, batch_id: str) -> dict[str, Any]:
    resp = http.get(f"/batches/{batch_id}", headers=auth(secret))
    assert resp.status_code == 200, resp.text
    found: dict[str, Any] = resp.json()
    return found


def stored_files(platform: Any, owner: str) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(files.c.owner == owner)).scalar_one())


def objects(platform: Any) -> set[Path]:
    root = platform.settings.files_storage_dir()
    return {p for p in root.rglob("*") if p.is_file()}


# -- the seed's flow ----------------------------------------------------------------------


def test_create_upload_confirm_seal_completes_and_the_feed_says_so(
    http: TestClient, token: Token, worker: Any, tag: str
) -> None:
    alice, admin = token(f"alice-{tag}"), token(f"ops-{tag}", "admin")
    batch = new_batch(http, alice)
    assert (batch["status"], batch["owner"], batch["total"], batch["sealed"]) == (
        "open",
        f"alice-{tag}",
        0,
        False,
    )
    chess = put(http, alice, batch["id"], "chess")
    content = TOPICS["orchids"].encode()
    orchids = send(
        http, alice, batch["id"], "orchids.txt", iter([content[:50], content[50:]])
    ).json()  # chunked
    assert (chess["status"], chess["batch_id"], chess["name"]) == ("uploaded", batch["id"], "chess.txt")
    assert (orchids["size"], orchids["checksum"]) == (len(content), hashlib.sha256(content).hexdigest())
    listed = shown(http, alice, batch["id"])
    assert listed["total"] == 2 and [f["status"] for f in listed["files"]] == ["uploaded", "uploaded"]
    for f in (chess, orchids):
        confirmed = http.post(f"/files/{f['id']}/confirm", headers=auth(alice))
        assert confirmed.status_code == 200 and confirmed.json()["confirmed"] is True, confirmed.text
    again = http.post(f"/files/{chess['id']}/confirm", headers=auth(alice)).json()
    assert again["confirmed"] is False  # idempotent: one flow per file
    eventually(
        lambda: all(f["status"] == "ready" for f in shown(http, alice, batch["id"])["files"]), timeout=60
    )
    sealed = http.post(f"/batches/{batch['id']}/seal", headers=auth(alice)).json()
    assert (sealed["status"], sealed["total"], sealed["ready"], sealed["sealed"]) == ("completed", 2, 2, True)
    final = shown(http, alice, batch["id"])
    assert final["status"] == "completed" and {f["status"] for f in final["files"]} == {"ready"}
    # Batch and file events have no job: they are the owner's their body names.
    events = http.get("/events", params={"batch": batch["id"]}, headers=auth(alice)).json()["events"]
    topics = [e["topic"] for e in events]
    assert topics.count("batch.completed") == 1 and "batch.sealed" in topics
    assert topics.count("file.status_changed") >= 2  # each file: queued, …, ready
    assert events == http.get("/events", params={"batch": batch["id"]}, headers=auth(admin)).json()["events"]
    bob = token(f"bob-{tag}")
    assert http.get("/events", params={"batch": batch["id"]}, headers=auth(bob)).json()["events"] == []
    done = next(e for e in events if e["topic"] == "batch.completed")["body"]
    assert (done["total"], done["ready"], done["owner"]) == (2, 2, f"alice-{tag}")


def test_the_expected_count_seals_and_a_sealed_batch_takes_no_more_files(
    http: TestClient, platform: Any, token: Token, tag: str
) -> None:
    alice = token(f"alice-{tag}")
    batch = new_batch(http, alice, expected=1)
    put(http, alice, batch["id"], "chess")
    assert shown(http, alice, batch["id"])["sealed"] is True
    refused = problem(send(http, alice, batch["id"], "more.txt", b"more"), 409, "batch-closed")
    assert "sealed" in refused["detail"]
    assert stored_files(platform, f"alice-{tag}") == 1
    opened = new_batch(http, alice)
    assert http.post(f"/batches/{opened['id']}/seal", headers=auth(alice)).json()["status"] == "completed"
    problem(send(http, alice, opened["id"], "late.txt", b"late"), 409, "batch-closed")


def test_retry_failed_runs_a_failed_file_again(
    http: TestClient, platform: Any, token: Token, worker: Any, tag: str
) -> None:
    from pipelines.files import replace_content

    alice = token(f"alice-{tag}")
    batch = new_batch(http, alice, expected=2)
    empty = send(http, alice, batch["id"], "empty.txt", b"").json()  # no text: fails at once
    good = put(http, alice, batch["id"], "sourdough")
    for f in (empty, good):
        http.post(f"/files/{f['id']}/confirm", headers=auth(alice))
    eventually(lambda: shown(http, alice, batch["id"])["status"] == "completed", timeout=60)
    failed = shown(http, alice, batch["id"])
    assert (failed["failed"], failed["ready"]) == (1, 1)
    assert next(f for f in failed["files"] if f["id"] == empty["id"])["error_type"] == "EmptyDocument"
    replace_content(platform, empty["id"], b"Barn owls hunt at night over the meadow.")
    retried = http.post(f"/batches/{batch['id']}/retry-failed", headers=auth(alice))
    assert retried.status_code == 200 and retried.json()["retried"] == 1, retried.text
    assert len(retried.json()["job_ids"]) == 1
    eventually(lambda: file_row(platform, empty["id"])["status"] == "ready", timeout=60)
    eventually(lambda: shown(http, alice, batch["id"])["ready"] == 2, timeout=30)
    nothing = http.post(f"/batches/{batch['id']}/retry-failed", headers=auth(alice)).json()
    assert nothing == {"retried": 0, "job_ids": []}


def test_cancel_seals_the_batch_and_cancels_its_unfinished_files(
    http: TestClient, token: Token, tag: str
) -> None:
    alice = token(f"alice-{tag}")
    batch = new_batch(http, alice)
    put(http, alice, batch["id"], "chess")
    put(http, alice, batch["id"], "volcanoes")
    resp = http.post(f"/batches/{batch['id']}/cancel", headers=auth(alice))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["cancelled"] == 2 and (body["batch"]["status"], body["batch"]["cancelled"]) == (
        "completed",
        2,
    )
    assert http.post(f"/batches/{batch['id']}/cancel", headers=auth(alice)).json()["cancelled"] == 0


# -- tokens, scopes, owners: every endpoint -----------------------------------------------

# (method, path template, the scope it needs); {batch} and {file} are alice's.
ENDPOINTS = [
    ("POST", "/batches", "submit"),
    ("GET", "/batches/{batch}", "read"),
    ("POST", "/batches/{batch}/files", "submit"),
    ("POST", "/files/{file}/confirm", "submit"),
    ("POST", "/batches/{batch}/seal", "submit"),
    ("POST", "/batches/{batch}/cancel", "submit"),
    ("POST", "/batches/{batch}/retry-failed", "submit"),
]
WRONG_SCOPE = {"read": "submit", "submit": "read"}
IDS = [f"{m} {p}" for m, p, _ in ENDPOINTS]


@pytest.fixture
def alices(http: TestClient, token: Token, tag: str) -> dict[str, str]:
    """A batch of ``alice-<tag>`` with one uploaded file."""
    secret = token(f"alice-{tag}")
    batch = new_batch(http, secret)
    return {"batch": batch["id"], "file": put(http, secret, batch["id"], "lighthouses")["id"]}


def call(
    http: TestClient, endpoint: tuple[str, str, str], ids: dict[str, str], headers: dict[str, str]
) -> httpx.Response:
    method, path, _ = endpoint
    upload = path.endswith("/files")
    return http.request(
        method,
        path.format(**ids),
        params={"name": "x.txt"} if upload else None,
        content=b"some text" if upload else None,
        json={} if path == "/batches" else None,
        headers=headers,
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_no_token_or_a_dead_one_is_401(
    http: TestClient, platform: Any, token: Token, alices: dict[str, str], tag: str, endpoint: Any
) -> None:
    revoked = token(f"alice-{tag}")
    tokens.revoke(platform.engine, revoked.split("_")[1])
    for headers in ({}, auth("not-a-token"), auth(revoked)):
        problem(call(http, endpoint, alices, headers), 401, "unauthorized")
    assert call(http, endpoint, alices, {}).headers["WWW-Authenticate"].startswith("Bearer")
    assert shown(http, token(f"alice-{tag}"), alices["batch"])["total"] == 1  # nothing happened


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_a_token_without_the_scope_is_403(
    http: TestClient, token: Token, alices: dict[str, str], tag: str, endpoint: Any
) -> None:
    resp = call(http, endpoint, alices, auth(token(f"alice-{tag}", WRONG_SCOPE[endpoint[2]])))
    assert endpoint[2] in problem(resp, 403, "forbidden")["detail"]
    assert shown(http, token(f"alice-{tag}"), alices["batch"])["total"] == 1


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_another_owners_batch_or_file_is_404_unless_admin(
    http: TestClient, platform: Any, token: Token, alices: dict[str, str], tag: str, endpoint: Any
) -> None:
    alice, bob, admin = token(f"alice-{tag}"), token(f"bob-{tag}"), token(f"ops-{tag}", "admin")
    if endpoint[1] == "/batches":  # a new batch is the caller's own
        made = call(http, endpoint, alices, auth(bob)).json()
        assert made["owner"] == f"bob-{tag}"
        problem(http.get(f"/batches/{made['id']}", headers=auth(alice)), 404, "not-found")
        return
    theirs = problem(call(http, endpoint, alices, auth(bob)), 404, "not-found")
    missing = {
        "batch": "0" * 8 + "-0000-4000-8000-" + "0" * 12,
        "file": "f" * 8 + "-0000-4000-8000-" + "0" * 12,
    }
    absent = problem(call(http, endpoint, missing, auth(bob)), 404, "not-found")
    assert theirs["detail"].replace(alices["batch"], "X").replace(alices["file"], "X") == (
        absent["detail"].replace(missing["batch"], "X").replace(missing["file"], "X")
    )
    assert shown(http, alice, alices["batch"])["total"] == 1  # bob changed nothing
    as_admin = call(http, endpoint, alices, auth(admin))
    assert as_admin.status_code in (200, 201), as_admin.text
    if endpoint[1].endswith("/files"):  # an admin's upload joins the batch's owner
        assert as_admin.json()["batch_id"] == alices["batch"]
        assert stored_files(platform, f"alice-{tag}") == 2 and stored_files(platform, f"ops-{tag}") == 0


# -- sizes and streams --------------------------------------------------------------------


def test_an_upload_over_max_bytes_is_413_declared_or_chunked_and_leaves_nothing(
    http: TestClient, platform: Any, token: Token, small_limit: int, tag: str
) -> None:
    alice = token(f"alice-{tag}")
    batch = new_batch(http, alice)
    before = objects(platform)
    declared = problem(
        send(http, alice, batch["id"], "big.bin", b"x" * (small_limit + 1)), 413, "file-too-large"
    )
    assert "over the 0.2 MiB limit" in declared["detail"]
    chunks = (b"y" * 65536 for _ in range(small_limit // 65536 + 2))  # no Content-Length
    problem(send(http, alice, batch["id"], "big.bin", chunks), 413, "file-too-large")
    exact = send(http, alice, batch["id"], "exact.bin", b"z" * small_limit)
    assert exact.status_code == 201 and exact.json()["size"] == small_limit
    assert stored_files(platform, f"alice-{tag}") == 1 and shown(http, alice, batch["id"])["total"] == 1
    assert len(objects(platform) - before) == 1


GONE = b"<disconnect>"


def asgi_upload(app: FastAPI, path: str, secret: str, body: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """POST ``path`` to ``app`` straight through ASGI, its body pulled from the iterator
    ``body`` a message at a time (:data:`GONE`: the client disconnects); returns (status,
    problem, bytes the app pulled)."""
    pulled = 0
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        chunk = next(body, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        if chunk is GONE:
            return {"type": "http.disconnect"}
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send_(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"name=big.bin",
        "headers": [(b"host", b"test"), (b"authorization", f"Bearer {secret}".encode()), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
        "state": {},
    }
    anyio.run(app, scope, receive, send_)
    return answer["status"], json.loads(answer["body"]), pulled


def test_the_app_refuses_by_content_length_before_reading_and_stops_reading_a_chunked_body_at_the_limit(
    app: FastAPI, http: TestClient, platform: Any, token: Token, small_limit: int, tag: str
) -> None:
    alice = token(f"alice-{tag}")
    path = f"/batches/{new_batch(http, alice)['id']}/files"
    endless = iter(lambda: b"a" * 65536, None)  # never ends
    status, body, pulled = asgi_upload(app, path, alice, endless, [(b"content-length", b"%d" % (1 << 40))])
    assert (status, body["type"], pulled) == (413, "urn:conveyor:problem:file-too-large", 0)
    assert "over the" in body["detail"]
    status, body, pulled = asgi_upload(app, path, alice, iter(lambda: b"b" * 65536, None), [])
    assert (status, body["type"]) == (413, "urn:conveyor:problem:file-too-large")
    assert small_limit < pulled <= small_limit + 65536  # one chunk past the limit, never more
    status, body, pulled = asgi_upload(app, path, alice, iter([b"c" * 1000, GONE]), [])
    assert (status, body["type"]) == (400, "urn:conveyor:problem:upload-interrupted")
    assert stored_files(platform, f"alice-{tag}") == 0


def test_a_storage_outage_is_503_and_leaves_no_file(
    http: TestClient, platform: Any, token: Token, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipelines.files.batches
    from tasks.files.errors import StorageUnavailable

    class Down:
        def ref_for(self, key: str) -> str:
            return f"file://{key}"

        def put_stream(self, key: str, source: Any, max_bytes: int) -> Any:
            raise StorageUnavailable(f"storage unavailable (put {key!r}): timed out")

        def delete(self, ref: str) -> None:
            pass

    alice = token(f"alice-{tag}")
    batch_id = new_batch(http, alice)["id"]
    monkeypatch.setattr(pipelines.files.batches, "_new_storage", Down)
    down = problem(send(http, alice, batch_id, "a.txt", b"text"), 503, "unavailable")
    assert down["detail"] == "the file storage did not answer; try again" and f"alice-{tag}" not in str(down)
    assert stored_files(platform, f"alice-{tag}") == 0


def test_conveyor_serve_serves_batches_and_cuts_an_endless_upload_short(
    platform: Any, token: Token, tmp_path: Path, tag: str
) -> None:
    alice = token(f"alice-{tag}")
    env = {"CONVEYOR_FILES": json.dumps({"max_bytes": LIMIT})}
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        while sent < 256 * LIMIT:  # bounded only so that a failing test ends
            sent += 65536
            yield b"e" * 65536

    with (
        serving(platform, tmp_path / "serve.log", env) as (base, _),
        httpx.Client(base_url=base, headers=auth(alice), timeout=30) as web,
    ):
        made = web.post("/batches", json={})
        assert made.status_code == 201, made.text
        batch_id = made.json()["id"]
        ok = web.post(f"/batches/{batch_id}/files", params={"name": "a.txt"}, content=b"tiny")
        assert ok.status_code == 201 and ok.json()["size"] == 4
        try:
            resp = web.post(f"/batches/{batch_id}/files", params={"name": "e.bin"}, content=endless())
            assert resp.status_code == 413 and resp.json()["type"] == "urn:conveyor:problem:file-too-large"
        except httpx.TransportError:  # the server answered and closed while the body was going out
            pass
        assert sent < 256 * LIMIT  # the server stopped reading long before the end
        assert web.get(f"/batches/{batch_id}").json()["total"] == 1
    assert stored_files(platform, f"alice-{tag}") == 1


# -- hostile input ------------------------------------------------------------------------


def test_hostile_ids_names_and_bodies_are_4xx_never_500(http: TestClient, token: Token, tag: str) -> None:
    alice = token(f"alice-{tag}")
    batch_id = new_batch(http, alice)["id"]
    for bad in ("nope", "%00", "a%00b", "x" * 64, "%F0%9F%92%A9", "..%2F..%2Fetc", batch_id.upper()):
        for method, path in (
            ("GET", f"/batches/{bad}"),
            ("POST", f"/batches/{bad}/seal"),
            ("POST", f"/batches/{bad}/cancel"),
            ("POST", f"/batches/{bad}/retry-failed"),
            ("POST", f"/files/{bad}/confirm"),
        ):
            resp = http.request(method, path, headers=auth(alice))
            assert resp.status_code == 404, (path, resp.text)
        assert send(http, alice, bad, "x.txt", b"x").status_code == 404
    assert http.get(f"/batches/{'x' * 65}", headers=auth(alice)).status_code == 422
    for body in ({"expected": -1}, {"expected": "two"}, {"expected": 2**40}, {"expected": 1.5}, {"other": 1}):
        problem(http.post("/batches", json=body, headers=auth(alice)), 422, "invalid-request")
    problem(http.post("/batches", content=b"{not json", headers=auth(alice)), 422)
    problem(send(http, alice, batch_id, "n" * 1001, b"x"), 422, "invalid-request")
    problem(http.post(f"/batches/{batch_id}/files", content=b"x", headers=auth(alice)), 422)  # no name
    form = http.post(f"/batches/{batch_id}/files?name=a", files={"f": ("a", b"x")}, headers=auth(alice))
    assert "--data-binary" in problem(form, 415, "unsupported-media-type")["detail"]
    assert form.headers["Connection"] == "close"  # the form was not read
    named = {
        "a\x00b.txt": "ab.txt",
        "../../etc/passwd": "passwd",
        "\x00": "file",
        "é" * 900: "é" * 500,
    }
    for name, kept in named.items():
        resp = send(http, alice, batch_id, name, b"text")
        assert resp.status_code == 201, (name, resp.text)
        assert resp.json()["name"] == kept
    assert shown(http, alice, batch_id)["total"] == len(named)


# -- SQLite -------------------------------------------------------------------------------


def test_on_sqlite(on_sqlite: Any, tag: str) -> None:
    registry.write(on_sqlite.engine, on_sqlite.stages.values())
    client = conveyor.connect(
        database_url=on_sqlite.settings.database_url, redis_url=on_sqlite.settings.redis_url
    )
    alice = tokens.create(on_sqlite.engine, owner=f"alice-{tag}", scopes=["read", "submit"]).secret
    bob = tokens.create(on_sqlite.engine, owner=f"bob-{tag}", scopes=["read", "submit"]).secret
    try:
        with TestClient(create_app(client, routers=[files_router])) as web:
            batch = new_batch(web, alice)
            put(web, alice, batch["id"], "chess")
            put(web, alice, batch["id"], "orchids")
            assert [f["status"] for f in shown(web, alice, batch["id"])["files"]] == ["uploaded"] * 2
            problem(web.get(f"/batches/{batch['id']}", headers=auth(bob)), 404)
            cancelled = web.post(f"/batches/{batch['id']}/cancel", headers=auth(alice)).json()
            assert cancelled["cancelled"] == 2 and cancelled["batch"]["status"] == "completed"
            problem(send(web, alice, batch["id"], "late.txt", b"late"), 409, "batch-closed")
            empty = new_batch(web, alice, expected=0)
            assert empty["status"] == "completed"
    finally:
        client.close()
