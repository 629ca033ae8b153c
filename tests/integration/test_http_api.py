"""The HTTP API (``conveyor.web``) in process, through FastAPI's TestClient, on the test
Postgres and Redis with an in-process worker: tokens and scopes, owners, submit by name
with the client's validation and idempotency, show, cancel, and problem details."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import conveyor
from conveyor.client import registry
from conveyor.errors import OwnerInvalid
from conveyor.store.db import schema as s
from conveyor.web import create_app, tokens
from tests.integration.http_support import Token, auth, problem, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("read", "submit")


def submit(http: TestClient, secret: str, stage: str = "conveyor.demo.square", **body: Any) -> httpx.Response:
    return http.post("/jobs", json={"stage": stage, "payload": {"n": 3}, **body}, headers=auth(secret))


# Every endpoint: (method, path template, the scope it needs, a body).
ENDPOINTS = [
    ("POST", "/jobs", "submit", {"stage": "conveyor.demo.square", "payload": {"n": 1}}),
    ("GET", "/jobs/{id}", "read", None),
    ("POST", "/jobs/{id}/cancel", "submit", {"reason": "test"}),
]
WRONG_SCOPE = {"read": "submit", "submit": "read"}


@pytest.fixture
def alices_job(http: TestClient, token: Token, tag: str) -> str:
    """A job of owner ``alice-<tag>``, due in a minute (nothing runs it meanwhile)."""
    resp = submit(http, token(f"alice-{tag}"), delay=60)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def call(http: TestClient, endpoint: tuple[Any, ...], job_id: str, headers: dict[str, str]) -> httpx.Response:
    method, path, _, body = endpoint
    return http.request(method, path.format(id=job_id), json=body, headers=headers)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
def test_no_token_bad_tokens_and_a_revoked_one_are_401(
    http: TestClient, platform: Any, token: Token, alices_job: str, tag: str, endpoint: Any
) -> None:
    live, revoked = token(f"alice-{tag}", "read", "submit"), token(f"alice-{tag}", "read", "submit")
    tokens.revoke(platform.engine, revoked.split("_")[1])
    forged = live[:-4] + ("AAAA" if not live.endswith("AAAA") else "BBBB")  # right id, wrong secret
    for headers in (
        {},
        {"Authorization": f"Basic {revoked}"},
        auth("not-a-token"),
        auth(forged),
        auth(revoked),
    ):
        body = problem(call(http, endpoint, alices_job, headers), 401, "unauthorized")
        assert revoked[20:] not in str(body)
    assert call(http, endpoint, alices_job, {}).headers["WWW-Authenticate"].startswith("Bearer")
    assert http.get(f"/jobs/{alices_job}", headers=auth(live)).json()["status"] == s.QUEUED


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
def test_a_token_without_the_scope_is_403(
    http: TestClient, token: Token, alices_job: str, tag: str, endpoint: Any
) -> None:
    lacking = token(f"alice-{tag}", WRONG_SCOPE[endpoint[2]])
    resp = call(http, endpoint, alices_job, auth(lacking))
    assert endpoint[2] in problem(resp, 403, "forbidden")["detail"]
    assert "insufficient_scope" in resp.headers["WWW-Authenticate"]


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
def test_another_owners_job_is_404_unless_admin(
    http: TestClient, token: Token, alices_job: str, tag: str, endpoint: Any
) -> None:
    bob, admin = token(f"bob-{tag}"), token(f"ops-{tag}", "admin")
    if endpoint[1] == "/jobs":  # a submit is the caller's own: bob's job, not alice's
        made = call(http, endpoint, alices_job, auth(bob))
        assert made.status_code == 201 and made.json()["owner"] == f"bob-{tag}"
        assert problem(http.get(f"/jobs/{made.json()['id']}", headers=auth(token(f"alice-{tag}"))), 404)
        return
    theirs = problem(call(http, endpoint, alices_job, auth(bob)), 404, "not-found")
    missing = problem(call(http, endpoint, "no-such-job", auth(bob)), 404, "not-found")
    assert theirs["title"] == missing["title"] and theirs["detail"].replace(alices_job, "X") == (
        missing["detail"].replace("no-such-job", "X")
    )
    assert http.get(f"/jobs/{alices_job}", headers=auth(admin)).json()["status"] == s.QUEUED  # not cancelled
    assert call(http, endpoint, alices_job, auth(admin)).status_code == 200


def test_submit_by_name_is_run_by_a_worker_and_shown(
    http: TestClient, client: conveyor.Client, token: Token, worker: Any, tag: str
) -> None:
    secret = token(f"alice-{tag}")
    resp = submit(http, secret, payload={"n": 7}, idempotency_key=f"{tag}-square")
    assert resp.status_code == 201 and resp.headers["Location"] == f"/jobs/{resp.json()['id']}"
    made = resp.json()
    assert made["deduplicated"] is False and made["owner"] == f"alice-{tag}"
    assert made["idempotency_key"] == f"{tag}-square" and made["label"] == "square"
    assert client.job(made["id"]).wait(30) == s.SUCCEEDED
    shown = http.get(f"/jobs/{made['id']}", headers=auth(secret)).json()
    assert shown["status"] == s.SUCCEEDED and shown["result"] == {"n": 49} and shown["error"] is None
    assert shown["attempts"] == {"counted": 1, "uncounted": 0, "requeued": 0, "claims": 1, "max": 3}
    topics = [e["topic"] for e in shown["events"]]
    assert topics[0] == "job.submitted" and "job.succeeded" in topics
    later = http.get(
        f"/jobs/{made['id']}", params={"events_since": shown["events_cursor"]}, headers=auth(secret)
    )
    assert later.json()["events"] == []
    bad_cursor = http.get(f"/jobs/{made['id']}", params={"events_since": "x:y:z"}, headers=auth(secret))
    problem(bad_cursor, 422, "invalid-cursor")


def test_show_waits_for_the_job_when_asked(http: TestClient, token: Token, worker: Any, tag: str) -> None:
    secret = token(f"alice-{tag}")
    made = submit(http, secret, payload={"n": 8}).json()
    shown = http.get(f"/jobs/{made['id']}", params={"wait": 20}, headers=auth(secret)).json()
    assert shown["status"] == s.SUCCEEDED and shown["result"] == {"n": 64}
    # Not terminal within the wait: the job as it is then, not an error.
    delayed = submit(http, secret, delay=60).json()
    started = time.monotonic()
    resp = http.get(f"/jobs/{delayed['id']}", params={"wait": 1}, headers=auth(secret))
    assert resp.status_code == 200 and resp.json()["status"] == s.QUEUED
    assert 0.9 <= time.monotonic() - started < 10
    problem(http.get(f"/jobs/{delayed['id']}", params={"wait": 31}, headers=auth(secret)), 422)
    http.post(f"/jobs/{delayed['id']}/cancel", headers=auth(secret))  # not left to fall due later


def test_waits_held_open_are_bounded(platform: Any, token: Token, tag: str) -> None:
    settings = platform.settings.model_copy(update={"http_max_held": 1})
    c = conveyor.Client(settings)
    with TestClient(create_app(c)) as api:
        secret = token(f"alice-{tag}")
        made = api.post(
            "/jobs",
            json={"stage": "conveyor.demo.square", "payload": {"n": 1}, "delay": 60},
            headers=auth(secret),
        ).json()
        first: list[int] = []
        holder = threading.Thread(
            target=lambda: first.append(
                api.get(f"/jobs/{made['id']}", params={"wait": 3}, headers=auth(secret)).status_code
            )
        )
        holder.start()
        time.sleep(1)
        busy = problem(api.get(f"/jobs/{made['id']}", params={"wait": 1}, headers=auth(secret)), 503, "busy")
        assert "try again" in busy["detail"]
        # A show that does not wait is never refused.
        assert api.get(f"/jobs/{made['id']}", headers=auth(secret)).status_code == 200
        holder.join(10)
        assert first == [200]
        assert api.get(f"/jobs/{made['id']}", params={"wait": 0.2}, headers=auth(secret)).status_code == 200
        api.post(f"/jobs/{made['id']}/cancel", headers=auth(secret))
    c.close()


def test_an_idempotency_key_twice_is_one_job_per_owner(
    http: TestClient, client: conveyor.Client, token: Token, tag: str
) -> None:
    alice, bob = token(f"alice-{tag}"), token(f"bob-{tag}")
    key = f"{tag}-order-42"
    first = submit(http, alice, idempotency_key=key, delay=60)
    again = submit(http, alice, idempotency_key=key, delay=60, payload={"n": 9})
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["deduplicated"] is True
    # The Python client naming the same owner finds it too; another owner's key is its own.
    same = client.submit("conveyor.demo.square", {"n": 3}, idempotency_key=key, owner=f"alice-{tag}")
    assert same.id == first.json()["id"] and same.deduplicated
    bobs = submit(http, bob, idempotency_key=key, delay=60)
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    assert client.submit("conveyor.demo.square", {"n": 3}, idempotency_key=key).id not in (
        first.json()["id"],
        bobs.json()["id"],
    )


def test_a_stage_dedup_into_another_owners_job_is_a_conflict(
    http: TestClient, token: Token, tag: str
) -> None:
    payload = {"user": tag, "note": tag, "sleep": 0}
    first = submit(http, token(f"alice-{tag}"), stage="conveyor.demo.keyed", payload=payload, delay=60)
    assert first.status_code == 201
    resp = submit(http, token(f"bob-{tag}"), stage="conveyor.demo.keyed", payload=payload, delay=60)
    body = problem(resp, 409, "duplicate-of-another-owner")
    assert first.json()["id"] not in resp.text and "alice" not in body["detail"]
    mine = submit(http, token(f"alice-{tag}"), stage="conveyor.demo.keyed", payload=payload)
    assert mine.status_code == 200 and mine.json()["id"] == first.json()["id"]


def test_an_invalid_payload_is_a_problem_naming_the_field(http: TestClient, token: Token, tag: str) -> None:
    secret = token(f"alice-{tag}")
    body = problem(submit(http, secret, payload={"n": "seven"}), 422, "invalid-payload")
    assert [e["field"] for e in body["errors"]] == ["payload.n"]
    assert "seven" not in str(body)
    missing = problem(submit(http, secret, payload={}), 422, "invalid-payload")
    assert missing["errors"] == [{"field": "payload.n", "message": "Field required"}]


def test_an_unknown_stage_is_a_problem_with_close_names(http: TestClient, token: Token, tag: str) -> None:
    body = problem(submit(http, token(f"alice-{tag}"), stage="conveyor.demo.sqare"), 422, "unknown-stage")
    assert "conveyor.demo.square" in body["suggestions"] and "conveyor.demo.square" in body["detail"]


def test_malformed_requests_are_problems_too(http: TestClient, token: Token, tag: str) -> None:
    headers = {**auth(token(f"alice-{tag}")), "Content-Type": "application/json"}
    broken = problem(http.post("/jobs", content=b'{"stage": ', headers=headers), 422, "invalid-request")
    assert broken["errors"]
    no_stage = problem(
        http.post("/jobs", json={"payload": {"n": 1}}, headers=headers), 422, "invalid-request"
    )
    assert {"field": "body.stage", "message": "Field required"} in no_stage["errors"]
    extra = http.post("/jobs", json={"stage": "conveyor.demo.square", "owner": "bob"}, headers=headers)
    assert problem(extra, 422, "invalid-request")["errors"][0]["field"] == "body.owner"
    negative = http.post("/jobs", json={"stage": "conveyor.demo.square", "delay": -1}, headers=headers)
    assert "input" not in problem(negative, 422)["errors"][0]
    huge = http.post("/jobs", json={"stage": "conveyor.demo.square", "priority": 2**40}, headers=headers)
    assert problem(huge, 422, "invalid-request")["errors"][0]["field"] == "body.priority"
    problem(http.get("/no/such/route"), 404)
    problem(http.delete("/jobs", headers=headers), 405)


def test_large_bodies_are_refused_before_parsing(http: TestClient, token: Token, tag: str) -> None:
    headers = {**auth(token(f"alice-{tag}")), "Content-Type": "application/json"}
    blob = b'{"stage": "conveyor.demo.square", "payload": {"n": 1, "x": "' + b"a" * 2_000_000 + b'"}}'
    problem(http.post("/jobs", content=blob, headers=headers), 413, "too-large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(blob), 65536):
            yield blob[start : start + 65536]

    problem(http.post("/jobs", content=chunks(), headers=headers), 413, "too-large")
    over = {"stage": "conveyor.demo.square", "payload": {"n": 1, "pad": "a" * 70_000}}
    assert "conveyor.demo.square" in problem(http.post("/jobs", json=over, headers=headers), 413)["detail"]


def test_cancel_records_the_token_and_is_idempotent(
    http: TestClient, token: Token, platform: Any, tag: str
) -> None:
    secret = token(f"alice-{tag}")
    job_id = submit(http, secret, delay=60).json()["id"]
    first = http.post(f"/jobs/{job_id}/cancel", json={"reason": "changed my mind"}, headers=auth(secret))
    assert first.status_code == 200 and first.json()["status"] == s.CANCELLED
    token_id = secret.split("_")[1]
    assert first.json()["cancel"]["by"] == f"token:{token_id}"
    assert first.json()["cancel"]["reason"] == "changed my mind"
    again = http.post(f"/jobs/{job_id}/cancel", headers=auth(secret))
    assert again.status_code == 200 and again.json()["status"] == s.CANCELLED
    assert tokens.listed(platform.engine, owner=f"alice-{tag}")[0].last_used_at is not None


def test_the_root_leads_a_person_to_the_console(http: TestClient) -> None:
    resp = http.get("/", follow_redirects=False)
    assert resp.status_code == 307 and resp.headers["location"] == "/console"
    assert http.get("/").url.path == "/console/login"  # not signed in yet


def test_health_and_a_database_that_does_not_answer(http: TestClient, platform: Any, token: Token) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    down = conveyor.connect(
        database_url="postgresql://postgres@127.0.0.1:1/nothing", redis_url="redis://127.0.0.1:1/0"
    )
    with TestClient(create_app(down)) as unreachable:
        problem(unreachable.get("/health"), 503, "unavailable")
        resp = submit(unreachable, token("alice"))
        assert problem(resp, 503, "unavailable") and resp.headers["Retry-After"]
    down.close()


def test_a_database_not_upgraded_says_so(tmp_path: Any, token: Token) -> None:
    empty = conveyor.connect(database_url=f"sqlite:///{tmp_path}/empty.db", redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(empty)) as http:
        for resp in (http.get("/health"), submit(http, token("alice"))):
            assert "conveyor db upgrade" in problem(resp, 503, "unavailable")["detail"]
    empty.close()


def test_no_token_reaches_the_logs(
    http: TestClient, platform: Any, token: Token, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret, revoked = token(f"alice-{tag}"), token(f"alice-{tag}")
    tokens.revoke(platform.engine, revoked.split("_")[1])
    with caplog.at_level(logging.DEBUG):
        job_id = submit(http, secret).json()["id"]
        http.get(f"/jobs/{job_id}", headers=auth(secret))
        http.get(f"/jobs/{job_id}", headers=auth(revoked))
        http.post("/jobs", content=b"{", headers={**auth(secret), "Content-Type": "application/json"})
    assert caplog.records  # SQL, HTTP and Conveyor's own loggers did write
    logged = caplog.text + " ".join(str(r.args) for r in caplog.records)
    for bearer in (secret, revoked):
        assert bearer.split("_", 2)[2] not in logged


def test_owners_from_python(client: conveyor.Client, platform: Any, tag: str) -> None:
    job = client.submit("conveyor.demo.square", {"n": 2}, owner=f"carol-{tag}", delay=60)
    row = job.row()
    assert row["owner"] == f"carol-{tag}" and row["idempotency_key"] is None
    keyed = platform.submit(
        "conveyor.demo.square", {"n": 2}, owner=f"carol-{tag}", idempotency_key="k", delay=60
    )
    assert keyed.row()["owner"] == f"carol-{tag}" and keyed.row()["idempotency_key"] == f"carol-{tag}:k"
    for bad in ("", "a:b", "x" * 65, "-lead", "sp ace"):
        with pytest.raises(OwnerInvalid):
            client.submit("conveyor.demo.square", {"n": 2}, owner=bad)


@pytest.mark.sqlite
def test_on_sqlite(on_sqlite: Any, tag: str) -> None:
    registry.write(on_sqlite.engine, on_sqlite.stages.values())
    client = conveyor.connect(
        database_url=on_sqlite.settings.database_url, redis_url=on_sqlite.settings.redis_url
    )
    alice = tokens.create(on_sqlite.engine, owner="alice", scopes=["read", "submit"]).secret
    bob = tokens.create(on_sqlite.engine, owner="bob", scopes=["submit"]).secret
    try:
        with TestClient(create_app(client)) as http:
            assert http.get("/health").status_code == 200
            first = submit(http, alice, idempotency_key=f"{tag}-k", delay=60)
            again = submit(http, alice, idempotency_key=f"{tag}-k", delay=60)
            assert (first.status_code, again.status_code) == (201, 200)
            job_id = first.json()["id"]
            assert again.json()["id"] == job_id
            assert http.get(f"/jobs/{job_id}", headers=auth(alice)).json()["owner"] == "alice"
            problem(http.get(f"/jobs/{job_id}", headers=auth(bob)), 403)
            problem(http.post(f"/jobs/{job_id}/cancel", headers=auth(bob)), 404)
            problem(http.get(f"/jobs/{job_id}"), 401)
            cancelled = http.post(f"/jobs/{job_id}/cancel", headers=auth(alice))
            assert cancelled.json()["status"] == s.CANCELLED
            problem(submit(http, alice, payload={"n": "x"}), 422, "invalid-payload")
    finally:
        client.close()


def test_text_with_a_nul_is_a_422_not_an_outage(http: TestClient, token: Token, tag: str) -> None:
    # Found by the contract run: Postgres refuses NUL in text, and that was a 503 "try again".
    secret = token(f"alice-{tag}")
    job_id = submit(http, secret, delay=60).json()["id"]
    for resp in (
        submit(http, secret, label="a\x00b"),
        submit(http, secret, idempotency_key="a\x00b"),
        http.post(
            "/jobs/dry-run",
            json={"stage": "conveyor.demo.square", "payload": {"n": 1}, "idempotency_key": "\x00"},
            headers=auth(secret),
        ),
        http.post(f"/jobs/{job_id}/cancel", json={"reason": "a\x00b"}, headers=auth(secret)),
        http.get("/jobs/a%00b", headers=auth(secret)),
        http.get("/events", params={"job": "a\x00b"}, headers=auth(secret)),
    ):
        assert "NUL" in problem(resp, 422, "invalid-value")["detail"] and "Retry-After" not in resp.headers


def test_bodies_keep_the_json_types_the_document_gives(http: TestClient, token: Token, tag: str) -> None:
    # Found by the contract run: lax validation took `"dedup": 0`, `"priority": false`, and
    # numbers (or numeric text) as run_at seconds since 1970.
    secret = token(f"alice-{tag}")
    for field, value in (
        ("dedup", 0),
        ("priority", False),
        ("max_attempts", "3"),
        ("delay", "1"),
        ("run_at", 5),
        ("run_at", "5"),
        ("run_at", "1e9"),
    ):
        body = problem(submit(http, secret, **{field: value}), 422, "invalid-request")
        assert body["errors"][0]["field"] == f"body.{field}", (field, value)
    naive = submit(http, secret, run_at="2100-01-01T00:00:00", delay=1)
    assert naive.status_code == 201 and naive.json()["run_at"].startswith("2100-01-01T00:00:00")
    assert submit(http, secret, delay=1, priority=2).status_code == 201
