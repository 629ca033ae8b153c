"""``/console`` in process (TestClient) on the test services: signing in with a pasted
token, the session cookie (and that the JSON API never takes it), CSRF on every POST,
scopes (read pages, admin dead letters), owners, and what the pages show. The browser
flow (a dead letter retried with a click) is tests/integration/test_console_browser.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select, update

import conveyor
from conveyor.store.db import schema as s
from conveyor.web import create_app
from conveyor.web.console import COOKIE
from tests.integration.http_support import Token, auth, problem, token_fixture

pytestmark = pytest.mark.timeout(60)

token = token_fixture("read")
PAGES = ["/console", "/console/jobs/x", "/console/dead-letters", "/console/batches", "/console/stream"]


@pytest.fixture
def browser(client: conveyor.Client) -> Iterator[TestClient]:
    """A fresh cookie jar on the app (``http`` is shared by the module)."""
    with TestClient(create_app(client), follow_redirects=False) as test_client:
        yield test_client


def sign_in(browser: TestClient, secret: str) -> None:
    resp = browser.post("/console/login", data={"token": secret})
    assert resp.status_code == 303 and resp.headers["location"] == "/console", resp.text


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, page
    return found.group(1)


def job_of(platform: Any, owner: str, stage: str = "conveyor.demo.square") -> str:
    return str(platform.submit(stage, {"n": 2}, owner=owner, delay=3600).id)


def dead_entry(platform: Any, job_id: str | None, stage: str) -> int:
    with platform.engine.begin() as conn:
        res = conn.execute(
            insert(s.dead_letters).values(
                job_id=job_id,
                stage=stage,
                queue="demo",
                label="l",
                error_type="PermanentError",
                message="m",
                traceback="tb",
                attempts=1,
                headers={},
                created_at=func.now(),
            )
        )
    return int(res.inserted_primary_key[0])


def test_a_bad_token_is_refused_at_sign_in(browser: TestClient, token: Token, tag: str) -> None:
    resp = browser.post("/console/login", data={"token": "cvy_0000000000000000_not-a-real-secret-at-all"})
    assert (
        resp.status_code == 401
        and "not valid" in resp.text
        and COOKIE not in resp.headers.get("set-cookie", "")
    )
    resp = browser.post("/console/login", data={"token": token(f"w-{tag}", "submit")})
    assert resp.status_code == 403 and "lacks the &#39;read&#39; scope" in resp.text
    assert browser.get("/console").status_code == 303


def test_a_sign_in_posted_from_another_site_is_refused(browser: TestClient, token: Token, tag: str) -> None:
    secret = token(f"ops-{tag}", "admin")
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        resp = browser.post("/console/login", data={"token": secret}, headers=headers)
        assert resp.status_code == 403 and "conveyor_console" not in resp.headers.get("set-cookie", "")
    sign_in(browser, secret)  # from the page itself (same origin, or a client without those headers)


def test_a_crafted_link_cannot_put_words_on_the_page(browser: TestClient, token: Token, tag: str) -> None:
    sign_in(browser, token(f"ops-{tag}", "admin"))
    page = browser.get("/console/dead-letters", params={"summary": "Your session expired at evil.example"})
    assert page.status_code == 200 and "evil.example" not in page.text
    assert browser.get("/console/dead-letters", params={"retried": "<b>hi</b> there"}).status_code == 422
    done = browser.get("/console/dead-letters", params={"done": "3,1,0"}).text
    assert "3 retried, 1 requested of a worker, 0 refused." in done


@pytest.mark.parametrize("path", PAGES)
def test_without_a_cookie_every_page_goes_to_sign_in(browser: TestClient, path: str) -> None:
    resp = browser.get(path)
    assert resp.status_code == 303 and resp.headers["location"] == "/console/login"
    assert browser.get("/console/login").status_code == 200


def test_sign_in_sets_a_strict_http_only_cookie_of_the_console(
    browser: TestClient, token: Token, tag: str
) -> None:
    resp = browser.post("/console/login", data={"token": token(f"alice-{tag}")})
    cookie = resp.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/console" in cookie and "Secure" not in cookie  # plain http here
    page = browser.get("/console")
    assert page.status_code == 200 and "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert f"alice-{tag}" in page.text and 'data-stream="/console/stream?since=' in page.text
    # Signing out needs the form's CSRF value and forgets the cookie.
    assert browser.post("/console/logout").status_code == 403
    out = browser.post("/console/logout", data={"csrf": csrf_of(page.text)})
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
    assert browser.get("/console").status_code == 303


def test_a_read_token_gets_a_403_page_for_dead_letters(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    entry = dead_entry(platform, None, f"conveyor.demo.{tag}")
    sign_in(browser, token(f"alice-{tag}"))
    page = browser.get("/console")
    assert "/console/dead-letters" not in page.text  # no link to what it may not open
    resp = browser.get("/console/dead-letters")
    assert resp.status_code == 403 and "needs a token with the &#39;admin&#39; scope" in resp.text
    resp = browser.post(f"/console/dead-letters/{entry}/retry", data={"csrf": csrf_of(page.text)})
    assert resp.status_code == 403


def test_a_requested_retry_shows_as_pending(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    # Before this module's worker starts (the next test): a relay's pass performs (here,
    # refuses) a requested retry within 2 s, and the page would show that instead.
    assert not platform.background, "a relay runs in this process: it may take the request first"
    entry = dead_entry(platform, None, f"conveyor.demo.{tag}")
    with platform.engine.begin() as conn:
        conn.execute(
            update(s.dead_letters).where(s.dead_letters.c.id == entry).values(retry_requested_at=func.now())
        )
    sign_in(browser, token(f"ops-{tag}", "admin"))
    row = browser.get("/console/dead-letters", params={"fragment": "1"}).text
    row = row[row.index(f'id="entry-{entry}"') :].split("</tr>")[0]
    assert "retry pending" in row and "<button" not in row


def test_a_post_without_its_csrf_value_does_nothing(
    browser: TestClient, platform: Any, worker: Any, token: Token, tag: str
) -> None:
    job_id = job_of(platform, f"alice-{tag}")
    with platform.engine.begin() as conn:
        conn.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(status=s.DEAD))
    entry = dead_entry(platform, job_id, "conveyor.demo.square")
    sign_in(browser, token(f"ops-{tag}", "admin"))
    page = browser.get("/console/dead-letters")
    assert page.status_code == 200 and f'id="entry-{entry}"' in page.text
    for data in ({}, {"csrf": "0" * 64}, {"csrf": csrf_of(page.text)[:-1]}):
        assert browser.post(f"/console/dead-letters/{entry}/retry", data=data).status_code == 403
        assert browser.post("/console/dead-letters/retry", data=data).status_code == 403
    with platform.engine.connect() as conn:
        retried = conn.execute(select(s.dead_letters.c.retried_at).where(s.dead_letters.c.id == entry))
        assert retried.scalar() is None
    # With it, the retry is done and the row leaves the list.
    resp = browser.post(f"/console/dead-letters/{entry}/retry", data={"csrf": csrf_of(page.text)})
    assert resp.status_code == 303 and resp.headers["location"] == f"/console/dead-letters?retried={job_id}"
    after = browser.get(resp.headers["location"])
    assert f'id="entry-{entry}"' not in after.text and f"Job {job_id} is queued again." in after.text


def test_another_owners_job_is_404_and_absent_from_the_list(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    alices = job_of(platform, f"alice-{tag}")
    sign_in(browser, token(f"bob-{tag}"))
    resp = browser.get(f"/console/jobs/{alices}")
    assert resp.status_code == 404 and f"No job {alices}" in resp.text
    assert alices not in browser.get("/console").text
    sign_in(browser, token(f"ops-{tag}", "admin"))
    page = browser.get(f"/console/jobs/{alices}")
    assert page.status_code == 200 and 'id="job-status"' in page.text and "job.submitted" in page.text


def test_the_jobs_page_counts_by_state_and_filters(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    owner = f"carol-{tag}"
    mine = [job_of(platform, owner) for _ in range(2)]
    sign_in(browser, token(owner))
    page = browser.get("/console").text
    assert all(f'id="job-{j}"' in page for j in mine)
    assert re.search(r'data-state="queued"[^>]*>queued <span class="count">2</span>', page), page
    fragment = browser.get("/console", params={"state": "succeeded", "fragment": "1"}).text
    assert "<html" not in fragment and "No jobs." in fragment


def test_batch_progress_is_read_from_events_with_a_batch_id(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    owner = f"dan-{tag}"
    job_id = job_of(platform, owner)
    body = {"batch_id": f"b-{tag}", "owner": owner, "total": 4, "ready": 2, "failed": 1, "queued": 1}
    # As the files family emits them: no job, the batch's owner in the body; and one of a job.
    later = {**body, "batch_id": f"c-{tag}", "owner": "someone-else"}
    with platform.engine.begin() as conn:
        for job, event_body in ((None, body), (job_id, later)):
            event = {"job_id": job, "topic": "batch.progress", "body": event_body, "created_at": func.now()}
            conn.execute(insert(s.job_events).values(**event))
    sign_in(browser, token(owner))
    page = browser.get("/console/batches").text
    assert f"b-{tag}" in page and '<progress max="4" value="3"' in page
    assert f"c-{tag}" in page  # an event of dan's own job is his, whatever its body says
    sign_in(browser, token(f"erin-{tag}"))
    assert f"b-{tag}" not in browser.get("/console/batches").text  # not her batch


def test_the_json_api_never_takes_the_console_cookie(
    browser: TestClient, platform: Any, token: Token, tag: str
) -> None:
    job_id = job_of(platform, f"ops-{tag}")
    secret = token(f"ops-{tag}", "admin")
    sign_in(browser, secret)
    browser.cookies.set(COOKIE, secret)  # as if sent to every path, whatever its Path says
    for path in (f"/jobs/{job_id}", "/dead-letters", "/events", "/events/stream"):
        problem(browser.get(path), 401, "unauthorized")
    problem(browser.post(f"/jobs/{job_id}/cancel"), 401, "unauthorized")
    assert browser.get(f"/jobs/{job_id}", headers=auth(secret)).status_code == 200


def test_console_routes_stay_out_of_the_openapi_document(http: TestClient) -> None:
    assert not [p for p in http.get("/openapi.json").json()["paths"] if p.startswith("/console")]


def test_mounted_under_a_prefix_links_and_the_cookie_keep_it(
    client: conveyor.Client, token: Token, tag: str
) -> None:
    parent = FastAPI()
    parent.mount("/conveyor", create_app(client))
    with TestClient(parent, follow_redirects=False) as mounted:
        resp = mounted.post("/conveyor/console/login", data={"token": token(f"alice-{tag}")})
        assert resp.status_code == 303 and resp.headers["location"] == "/conveyor/console"
        assert "Path=/conveyor/console" in resp.headers["set-cookie"]
        page = mounted.get("/conveyor/console").text
        assert 'href="/conveyor/console/static/console.css"' in page
        assert 'data-stream="/conveyor/console/stream?since=' in page
        assert mounted.get("/conveyor/console/static/console.js").status_code == 200
