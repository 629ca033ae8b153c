"""``/dead-letters`` of the HTTP API in process, on the test Postgres and Redis with an
in-process worker: admin only, filters, cursor paging while entries arrive, retry one (the
job runs again), retry all matching a filter, a stage with an ``on_retry`` hook refused,
and purge."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select, update
from werkzeug.test import Client as WerkzeugClient

from conveyor.store.db import schema as s
from conveyor.web.wsgi import mount
from tests.integration.http_support import Token, auth, problem, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("admin")
ENDPOINTS = [
    ("GET", "/dead-letters", None),
    ("GET", "/dead-letters/{id}", None),
    ("POST", "/dead-letters/{id}/retry", None),
    ("POST", "/dead-letters/retry", {"stage": "conveyor.demo.none"}),
    ("POST", "/dead-letters/purge", {"stage": "conveyor.demo.none"}),
]


def entries(
    platform: Any, stage: str, n: int, *, queue: str = "demo", job_id: str | None = None
) -> list[int]:
    """``n`` entries of ``stage`` written as a dead-lettering worker does (no job unless given)."""
    ids = []
    with platform.engine.begin() as conn:
        for i in range(n):
            row = {"job_id": job_id, "stage": stage, "queue": queue, "label": f"e{i}", "error_type": "X"}
            res = conn.execute(
                insert(s.dead_letters).values(
                    **row, message="m", traceback="tb", attempts=1, headers={"h": i}, created_at=func.now()
                )
            )
            ids.append(int(res.inserted_primary_key[0]))
    return ids


def dead_job(http: TestClient, platform: Any, secret: str, n: int) -> tuple[str, int]:
    """A demo.broken job run to ``dead`` by the worker, and its open entry."""
    resp = http.post(
        "/jobs", json={"stage": "conveyor.demo.broken", "payload": {"n": n}}, headers=auth(secret)
    )
    job_id = resp.json()["id"]
    return job_id, open_entry(platform, job_id)


def open_entry(platform: Any, job_id: str, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with platform.engine.connect() as conn:
            found = conn.execute(
                select(s.dead_letters.c.id).where(
                    s.dead_letters.c.job_id == job_id, s.dead_letters.c.retried_at.is_(None)
                )
            ).scalar()
        if found is not None:
            return int(found)
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} was not dead-lettered")


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e[0]} {e[1]}")
def test_every_endpoint_is_401_without_a_token_and_403_without_admin(
    http: TestClient, platform: Any, token: Token, tag: str, endpoint: Any
) -> None:
    (entry,) = entries(platform, f"conveyor.demo.{tag}", 1)
    method, path, body = endpoint
    url = path.format(id=entry)
    problem(http.request(method, url, json=body), 401, "unauthorized")
    for scopes in (("read",), ("submit",), ("read", "submit")):
        resp = http.request(method, url, json=body, headers=auth(token(f"alice-{tag}", *scopes)))
        assert "admin" in problem(resp, 403, "forbidden")["detail"]
    if "{id}" in path:  # no owner applies (admin sees all): an unknown entry is 404
        missing = http.request(method, path.format(id=2**62), json=body, headers=auth(token(f"ops-{tag}")))
        problem(missing, 404, "not-found")


def test_filters_and_show(http: TestClient, platform: Any, token: Token, tag: str) -> None:
    admin = auth(token(f"ops-{tag}"))
    a, b = f"conveyor.demo.a{tag}", f"conveyor.demo.b{tag}"
    ids_a = entries(platform, a, 2)
    ids_b = entries(platform, b, 1, queue=f"q{tag}")
    got = http.get("/dead-letters", params={"stage": a}, headers=admin).json()
    assert [e["id"] for e in got["items"]] == sorted(ids_a, reverse=True) and got["next"] is None
    got = http.get("/dead-letters", params={"queue": f"q{tag}"}, headers=admin).json()
    assert [e["id"] for e in got["items"]] == ids_b
    future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    assert (
        http.get("/dead-letters", params={"stage": a, "since": future}, headers=admin).json()["items"] == []
    )
    assert (
        len(http.get("/dead-letters", params={"stage": a, "until": future}, headers=admin).json()["items"])
        == 2
    )
    shown = http.get(f"/dead-letters/{ids_b[0]}", headers=admin).json()
    assert shown["traceback"] == "tb" and shown["headers"] == {"h": 0} and shown["stage"] == b
    problem(http.get("/dead-letters", params={"cursor": "bogus"}, headers=admin), 422, "invalid-cursor")


def test_what_the_contract_run_found(http: TestClient, token: Token, tag: str) -> None:
    admin = auth(token(f"ops-{tag}"))
    # Times are ISO 8601 text, never seconds since 1970; NUL in text is a 422, not a 503.
    for params in ({"until": "0.5"}, {"since": "1700000000"}):
        problem(http.get("/dead-letters", params=params, headers=admin), 422, "invalid-request")
    problem(http.post("/dead-letters/retry", json={"since": 0}, headers=admin), 422, "invalid-request")
    problem(http.post("/dead-letters/purge", json={"all": 1}, headers=admin), 422, "invalid-request")
    problem(http.get("/dead-letters", params={"stage": "a\x00b"}, headers=admin), 422, "invalid-value")
    problem(http.post("/dead-letters/purge", json={"queue": "a\x00b"}, headers=admin), 422, "invalid-value")
    # A method /retry and /purge lack is 405 naming POST (it was GET /{entry_id}'s 422 or Allow: GET).
    for method in ("GET", "OPTIONS", "DELETE"):
        for path in ("/dead-letters/retry", "/dead-letters/purge"):
            resp = http.request(method, path, headers=admin)
            assert problem(resp, 405) and resp.headers["allow"] == "POST", (method, path)
    problem(http.get("/dead-letters/abc", headers=admin), 404)


def test_cursor_pages_have_no_duplicates_nor_gaps_while_entries_arrive(
    http: TestClient, platform: Any, token: Token, tag: str
) -> None:
    admin = auth(token(f"ops-{tag}"))
    stage = f"conveyor.demo.p{tag}"
    before = entries(platform, stage, 10)
    seen: list[int] = []
    url: str | None = f"/dead-letters?stage={stage}&limit=3"
    pages = 0
    while url:
        page = http.get(url, headers=admin).json()
        seen += [e["id"] for e in page["items"]]
        entries(platform, stage, 2)  # newer entries arrive between pages
        url, pages = page["next"], pages + 1
    assert seen == sorted(before, reverse=True) and pages == 4


def test_next_keeps_the_prefix_the_api_is_mounted_under(
    client: Any, platform: Any, token: Token, tag: str
) -> None:
    """Mounted in a WSGI app (conveyor.web.wsgi), the prefix is the API's root_path: ``next``
    names it once."""

    def shop(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"the shop's own"]

    http = WerkzeugClient(mount(shop, "/ops/conveyor", lambda: client))
    admin = auth(token(f"ops-{tag}"))
    stage = f"conveyor.demo.m{tag}"
    entries(platform, stage, 3)
    first = http.get(f"/ops/conveyor/dead-letters?stage={stage}&limit=2", headers=admin)
    assert first.status_code == 200, first.text
    assert first.json["next"].startswith(f"/ops/conveyor/dead-letters?stage={stage}&limit=2&cursor=")
    second = http.get(first.json["next"], headers=admin).json
    assert len(second["items"]) == 1 and second["next"] is None
    assert http.get("/ops/dead-letters").text == "the shop's own"


def test_retry_one_runs_the_job_again(
    http: TestClient, platform: Any, worker: Any, token: Token, tag: str
) -> None:
    admin = auth(token(f"ops-{tag}"))
    job_id, entry = dead_job(http, platform, token(f"alice-{tag}", "submit"), 1)
    resp = http.post(f"/dead-letters/{entry}/retry", headers=admin)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"job_id": job_id, "entry_id": entry, "requested": False}
    again = open_entry(platform, job_id)  # broken dies again: it ran once more
    assert again != entry
    job = http.get(f"/jobs/{job_id}", headers=admin).json()
    assert job["status"] == s.DEAD and job["attempts"]["claims"] == 2
    shown = http.get(f"/dead-letters/{entry}", headers=admin).json()
    assert shown["retried_at"] and shown["retried_by"].startswith("token:")
    problem(http.post(f"/dead-letters/{entry}/retry", headers=admin), 409, "not-retryable")


def test_retry_all_by_filter_and_a_stage_with_a_hook_is_asked_of_a_worker(
    http: TestClient, platform: Any, worker: Any, token: Token, tag: str
) -> None:
    admin = auth(token(f"ops-{tag}"))
    submitter = token(f"alice-{tag}", "submit")
    dead = [dead_job(http, platform, submitter, n) for n in (2, 3)]
    hooked = next(name for name, spec in platform.stages.items() if spec.on_retry is not None)
    hooked_job, hooked_entry = dead_job(http, platform, submitter, 4)
    stage = f"conveyor.demo.r{tag}"
    with platform.engine.begin() as conn:  # this test's own stage names, so the filter is its own
        for _, entry in dead:
            conn.execute(update(s.dead_letters).where(s.dead_letters.c.id == entry).values(stage=stage))
        conn.execute(update(s.jobs).where(s.jobs.c.id == hooked_job).values(stage=hooked))
    empty = problem(http.post("/dead-letters/retry", json={}, headers=admin), 422, "empty-filter")
    assert "all: true" in empty["detail"]  # a slip would retry every stage's dead letters
    done = http.post("/dead-letters/retry", json={"stage": stage}, headers=admin).json()
    assert done["retried"] == 2 and sorted(done["job_ids"]) == sorted(j for j, _ in dead)
    assert done["refused"] == [] and done["requested"] == []
    for job_id, _ in dead:
        open_entry(platform, job_id)
    # The hook is deployment code: the API asks a worker, whose relay runs it and retries.
    resp = http.post(f"/dead-letters/{hooked_entry}/retry", headers=admin)
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"job_id": hooked_job, "entry_id": hooked_entry, "requested": True}
    deadline = time.monotonic() + 20
    while (entry := http.get(f"/dead-letters/{hooked_entry}", headers=admin).json())["retried_at"] is None:
        assert entry["retry_refused"] is None, entry
        assert time.monotonic() < deadline, entry
        time.sleep(0.2)
    assert entry["retried_by"].startswith("token:") and entry["retry_requested_at"] is None
    topics = [e["topic"] for e in http.get(f"/jobs/{hooked_job}", headers=admin).json()["events"]]
    assert topics.count("job.dlq_retried") == 1
    again = http.post(f"/dead-letters/{hooked_entry}/retry", headers=admin)
    problem(again, 409, "not-retryable")


def test_a_requested_retry_the_worker_cannot_perform_says_why(
    http: TestClient, platform: Any, worker: Any, token: Token, tag: str
) -> None:
    admin = auth(token(f"ops-{tag}"))
    hooked = next(name for name, spec in platform.stages.items() if spec.on_retry is not None)
    job_id, entry_id = dead_job(http, platform, token(f"alice-{tag}", "submit"), 5)
    with platform.engine.begin() as conn:
        conn.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(stage=hooked))
    assert platform.dlq.request_retry(entry_id, by="test")
    with platform.engine.begin() as conn:  # meanwhile someone finished the job another way
        conn.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(status=s.SUCCEEDED))
    deadline = time.monotonic() + 20
    while (entry := http.get(f"/dead-letters/{entry_id}", headers=admin).json())["retry_refused"] is None:
        assert time.monotonic() < deadline, entry
        time.sleep(0.2)
    assert "no longer dead" in entry["retry_refused"]
    assert entry["retried_at"] is None and entry["retry_requested_at"] is None  # not tried forever


def test_purge_by_filter_refuses_an_empty_one(
    http: TestClient, platform: Any, token: Token, tag: str
) -> None:
    admin = auth(token(f"ops-{tag}"))
    stage = f"conveyor.demo.g{tag}"
    ids = entries(platform, stage, 3)
    keep = entries(platform, f"conveyor.demo.k{tag}", 1)
    problem(http.post("/dead-letters/purge", json={}, headers=admin), 422, "empty-filter")
    assert http.post("/dead-letters/purge", json={"stage": stage}, headers=admin).json() == {"purged": 3}
    for entry in ids:
        problem(http.get(f"/dead-letters/{entry}", headers=admin), 404, "not-found")
    assert http.get(f"/dead-letters/{keep[0]}", headers=admin).status_code == 200
