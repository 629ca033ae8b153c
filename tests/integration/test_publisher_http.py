"""The publisher family over HTTP (``/publisher/jobs``) with real services, an in-process
worker and a Graph-like peer: the same plan is one post, a refused plan names its field and
records nothing, a pending post is edited and cancelled, a failed one replays, owners see
only their own posts, and the seed's test inserts nothing."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from conveyor.store.db import schema as s
from conveyor.web import create_app, tokens
from pipelines.publisher.peers import GraphPeer
from tasks.publisher import tables as t
from tests.integration.http_support import auth, problem
from tests.integration.publisher_support import now, post_row, publisher_settings

pytestmark = pytest.mark.timeout(180)
JOBS = "/publisher/jobs"


@pytest.fixture(scope="module")
def http(platform: Any) -> Iterator[TestClient]:
    import conveyor as c

    client = c.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    from pipelines.publisher.http import router

    with TestClient(create_app(client, routers=[router])) as api:
        yield api
    client.close()


@pytest.fixture
def peer(platform: Any) -> Iterator[GraphPeer]:
    with GraphPeer() as graph, publisher_settings(platform, graph):
        yield graph


def body(
    tag: str, channel: str = "facebook", *, at: dt.datetime | None = None, **changes: Any
) -> dict[str, Any]:
    """A plan as the API takes it, due now unless ``at``."""
    values: dict[str, Any] = {
        "brand": f"brand-{tag}",
        "channel": channel,
        "account": f"acct-{tag}",
        "caption": f"Hello from {tag}",
        "scheduled_at": (at or now()).isoformat(),
        "media": ["https://cdn.example.test/a.jpg"] if channel == "instagram" else [],
    }
    return {**values, **changes}


def token(platform: Any, owner: str, *scopes: str) -> dict[str, str]:
    return auth(tokens.create(platform.engine, owner=owner, scopes=scopes or ("read", "submit")).secret)


def count(platform: Any, brand: str) -> int:
    with platform.engine.connect() as conn:
        query = select(func.count()).select_from(t.posts).where(t.posts.c.brand == brand)
        return int(conn.execute(query).scalar_one())


def test_schedule_is_idempotent_and_a_pending_post_is_edited_and_cancelled(
    platform: Any, peer: GraphPeer, http: TestClient, tag: str
) -> None:
    me = token(platform, f"pub-{tag}")
    later = now() + dt.timedelta(hours=1)
    made = http.post(JOBS, json=body(tag, at=later), headers=me)
    assert made.status_code == 201, made.text
    post = made.json()
    assert post["status"] == t.PENDING and post["existing"] is False and post["job_id"] == post["id"]
    assert made.headers["Location"].endswith(f"{JOBS}/{post['id']}")
    again = http.post(
        JOBS, json=body(tag, at=later.astimezone(dt.timezone(dt.timedelta(hours=2)))), headers=me
    )
    assert again.status_code == 200 and again.json()["existing"] is True and again.json()["id"] == post["id"]

    shown = http.get(f"{JOBS}/{post['id']}", headers=me)
    assert shown.status_code == 200 and shown.json()["job_status"] == s.QUEUED, shown.text
    edited = http.patch(
        f"{JOBS}/{post['id']}", json={"caption": "Edited {n}", "placeholders": {"n": 2}}, headers=me
    )
    assert edited.status_code == 200, edited.text
    assert (
        edited.json()["caption"] == "Edited 2" and edited.json()["idempotency_key"] != post["idempotency_key"]
    )
    bad_edit = problem(http.patch(f"{JOBS}/{post['id']}", json={"scheduled_at": "tomorrow"}, headers=me), 422)
    assert bad_edit["errors"][0]["field"] == "body.scheduled_at"

    cancelled = http.post(f"{JOBS}/{post['id']}/cancel", headers=me)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == t.CANCELLED
    twice = http.post(f"{JOBS}/{post['id']}/cancel", headers=me)  # cancelled already: the same answer
    assert twice.status_code == 200 and twice.json()["status"] == t.CANCELLED
    problem(http.patch(f"{JOBS}/{post['id']}", json={"caption": "late"}, headers=me), 409, "post-not-pending")

    preview = http.post(
        JOBS, json=body(f"{tag}p", caption="Hi {who}", placeholders={"who": "you"}, preview=True), headers=me
    )
    assert preview.status_code == 200 and preview.json()["preview"]["caption"] == "Hi you"
    assert count(platform, f"brand-{tag}p") == 0
    for unknown in ("no-such-post", "x" * 36, "a b"):
        problem(http.get(f"{JOBS}/{unknown}", headers=me), 404)
    problem(http.post(f"{JOBS}/no-such-post/replay", headers=me), 404)
    shared = ((JOBS, "GET, POST"), (f"{JOBS}/test", "POST"), (f"{JOBS}/{post['id']}", "GET, PATCH"))
    for path, allowed in shared:
        refused = http.request("DELETE", path, headers=me)
        assert problem(refused, 405)["title"] == "Method Not Allowed" and refused.headers["Allow"] == allowed
    assert peer.requests == []


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"channel": "tiktok"}, "channel"),
        ({"scheduled_at": "2030-01-01T09:00:00"}, "scheduled_at"),
        ({"channel": "instagram", "media": []}, "media"),
        ({"caption": "Hi {name}"}, "placeholders"),
        ({"media": ["ftp://x"]}, "media[0]"),
        ({"scheduled_at": "0001-01-01T00:30:00+01:00"}, "scheduled_at"),  # before year 1 in UTC
    ],
)
def test_a_refused_plan_is_422_naming_the_field_and_records_nothing(
    platform: Any, peer: GraphPeer, http: TestClient, tag: str, changes: dict[str, Any], field: str
) -> None:
    refused = problem(
        http.post(JOBS, json=body(tag, **changes), headers=token(platform, tag)), 422, "invalid-plan"
    )
    assert refused["errors"][0]["field"] == f"body.{field}" and refused["detail"].startswith(field)
    assert count(platform, f"brand-{tag}") == 0


def test_cancel_after_completion_is_409_and_a_failed_post_replays(
    platform: Any, worker: Any, peer: GraphPeer, http: TestClient, tag: str
) -> None:
    me = token(platform, f"pub-{tag}")
    done = http.post(JOBS, json=body(tag), headers=me).json()
    assert platform.job(done["job_id"]).wait(30) == s.SUCCEEDED
    problem(http.post(f"{JOBS}/{done['id']}/cancel", headers=me), 409, "post-not-pending")
    as_is = http.post(f"{JOBS}/{done['id']}/replay", headers=me)  # published: nothing again
    assert as_is.status_code == 200 and as_is.json()["status"] == t.COMPLETED

    account = f"acct-{tag}-b"
    peer.fail_next(1, status=400, code=100, path_contains=account)
    failed = http.post(JOBS, json=body(tag, account=account), headers=me).json()
    assert platform.job(failed["job_id"]).wait(30) == s.DEAD
    assert http.get(f"{JOBS}/{failed['id']}", headers=me).json()["status"] == t.FAILED
    replayed = http.post(f"{JOBS}/{failed['id']}/replay", headers=me)
    assert replayed.status_code == 200, replayed.text
    assert replayed.json()["status"] == t.PENDING and replayed.json()["attempts"] == 0
    assert platform.job(failed["job_id"]).wait(30) == s.SUCCEEDED
    assert len(peer.posts(account)) == 1
    assert post_row(platform, failed["id"])["idempotency_key"] == failed["idempotency_key"]

    waiting = http.post(JOBS, json=body(tag, at=now() + dt.timedelta(hours=1)), headers=me).json()
    problem(http.post(f"{JOBS}/{waiting['id']}/replay", headers=me), 409, "post-not-failed")
    http.post(f"{JOBS}/{waiting['id']}/cancel", headers=me)


def test_owners_see_only_their_own_posts(platform: Any, peer: GraphPeer, http: TestClient, tag: str) -> None:
    alice, bob = token(platform, f"alice-{tag}"), token(platform, f"bob-{tag}")
    admin = token(platform, "ops", "admin")
    reader = token(platform, f"alice-{tag}", "read")
    plan = body(tag, at=now() + dt.timedelta(hours=1))
    post = http.post(JOBS, json=plan, headers=alice).json()
    problem(http.post(JOBS, json=plan, headers=reader), 403)
    hidden = problem(http.post(JOBS, json=plan, headers=bob), 409, "duplicate-of-another-owner")
    assert post["id"] not in json.dumps(hidden)
    problem(http.get(f"{JOBS}/{post['id']}", headers=bob), 404)
    problem(http.patch(f"{JOBS}/{post['id']}", json={"caption": "mine"}, headers=bob), 404)
    problem(http.post(f"{JOBS}/{post['id']}/cancel", headers=bob), 404)
    problem(http.post(f"{JOBS}/{post['id']}/replay", headers=bob), 404)
    assert post["id"] not in {p["id"] for p in http.get(JOBS, headers=bob).json()["items"]}
    mine = http.get(JOBS, params={"status": "pending"}, headers=reader)
    assert post["id"] in {p["id"] for p in mine.json()["items"]}
    assert http.get(f"{JOBS}/{post['id']}", headers=admin).status_code == 200
    problem(http.get(JOBS, params={"status": "nope"}, headers=alice), 422)
    check = {
        "channel": "facebook",
        "account": f"acct-{tag}",
        "at": plan["scheduled_at"],
        "caption": plan["caption"],
        "brand": plan["brand"],
    }
    assert http.post(f"{JOBS}/test", json=check, headers=bob).json()["existing"] is None
    assert http.post(f"{JOBS}/test", json=check, headers=alice).json()["existing"] == post["id"]
    assert http.post(f"{JOBS}/{post['id']}/cancel", headers=alice).status_code == 200


def test_the_test_endpoint_inserts_nothing(platform: Any, http: TestClient, tag: str) -> None:
    at = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
    window = {
        "name": f"quiet-{tag}",
        "start": "11:00",
        "end": "13:00",
        "timezone": "UTC",
        "brands": [f"brand-{tag}"],
    }
    me = token(platform, f"pub-{tag}")
    with GraphPeer() as graph, publisher_settings(platform, graph, blackout_windows=[window]):
        check = {
            "channel": "instagram",
            "account": f"acct-{tag}",
            "at": at.isoformat(),
            "brand": f"brand-{tag}",
        }
        held = http.post(f"{JOBS}/test", json=check, headers=me)
        assert held.status_code == 200, held.text
        out = held.json()
        assert out["blackout"] == {"window": f"quiet-{tag}", "until": "2030-01-01T13:00:00Z"}
        assert out["would_run"] is False and out["channel_busy"] is False and out["account_busy"] is False
        assert out["idempotency_key"] is None
        keyed = http.post(
            f"{JOBS}/test", json={**check, "media": ["https://cdn.example.test/a.jpg"]}, headers=me
        )
        assert len(keyed.json()["idempotency_key"]) == 64
        free = http.post(f"{JOBS}/test", json={**check, "brand": f"other-{tag}"}, headers=me).json()
        assert free["would_run"] is True and free["blackout"] is None
        bad = problem(http.post(f"{JOBS}/test", json={**check, "at": "2030-01-01T12:00:00"}, headers=me), 422)
        assert bad["errors"][0]["field"] == "body.at"
        edge = problem(
            http.post(f"{JOBS}/test", json={**check, "at": "9999-12-31T23:59:59Z"}, headers=me), 422
        )
        assert edge["errors"][0]["field"] == "body.at"
        assert graph.requests == []
    assert count(platform, f"brand-{tag}") == 0
