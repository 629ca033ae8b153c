"""``POST /jobs/dry-run``: validated as a submit, answered from the same rules, nothing
inserted."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select

import conveyor
from conveyor.store.db import schema as s
from conveyor.web import create_app
from tests.integration.http_support import Token, auth, problem, token_fixture

pytestmark = pytest.mark.timeout(60)

token = token_fixture("read", "submit")


def count(platform: Any) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(s.jobs)).scalar_one())


def dry(http: TestClient, secret: str, stage: str = "conveyor.demo.square", **body: Any) -> Any:
    return http.post(
        "/jobs/dry-run", json={"stage": stage, "payload": {"n": 3}, **body}, headers=auth(secret)
    )


def codes(resp: Any) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [r["code"] for r in resp.json()["reasons"]]


def test_auth_and_validation_as_a_submit(http: TestClient, token: Token, tag: str) -> None:
    problem(dry(http, ""), 401)
    problem(http.post("/jobs/dry-run", json={"stage": "conveyor.demo.square"}), 401, "unauthorized")
    problem(dry(http, token(f"a-{tag}", "read")), 403, "forbidden")
    problem(dry(http, token(f"a-{tag}"), stage="conveyor.demo.squar"), 422, "unknown-stage")
    body = problem(
        http.post(
            "/jobs/dry-run",
            json={"stage": "conveyor.demo.square", "payload": {"n": "x"}},
            headers=auth(token(f"a-{tag}")),
        ),
        422,
        "invalid-payload",
    )
    assert body["errors"][0]["field"] == "payload.n"


def test_reasons_and_nothing_inserted(http: TestClient, platform: Any, token: Token, tag: str) -> None:
    alice, bob = token(f"alice-{tag}"), token(f"bob-{tag}")
    made = http.post(
        "/jobs",
        json={
            "stage": "conveyor.demo.square",
            "payload": {"n": 1},
            "delay": 60,
            "idempotency_key": f"k{tag}",
        },
        headers=auth(alice),
    ).json()
    keyed = http.post(
        "/jobs",
        json={"stage": "conveyor.demo.keyed", "payload": {"user": tag, "note": "n"}, "delay": 60},
        headers=auth(alice),
    ).json()
    rows = count(platform)
    resp = dry(http, alice)
    assert resp.json()["would_run_now"] is True and codes(resp) == []
    reasons = dry(http, alice, idempotency_key=f"k{tag}").json()["reasons"]
    assert reasons[0]["code"] == "idempotency_key" and reasons[0]["job_id"] == made["id"]
    assert codes(dry(http, bob, idempotency_key=f"k{tag}")) == []  # a key is its owner's own
    own = dry(http, alice, stage="conveyor.demo.keyed", payload={"user": tag, "note": "x"}).json()["reasons"]
    assert own == [{"code": "deduplicated", "detail": own[0]["detail"], "job_id": keyed["id"], "until": None}]
    other = dry(http, bob, stage="conveyor.demo.keyed", payload={"user": tag, "note": "x"}).json()["reasons"]
    assert other[0]["code"] == "deduplicated" and other[0]["job_id"] is None  # the fact, not the id
    assert (
        codes(dry(http, bob, stage="conveyor.demo.keyed", payload={"user": tag, "note": "x"}, dedup=False))
        == []
    )
    assert codes(dry(http, alice, delay=30)) == ["delayed"]
    assert codes(dry(http, alice, delay=30, expires_in=10)) == ["delayed", "expired"]
    with platform.engine.begin() as conn:  # a live holder of the sync stage's lease key
        conn.execute(
            insert(s.leases).values(
                key=f"user:{tag}",
                holder_job=made["id"],
                holder_attempt=1,
                token=1,
                priority=0,
                preemptable=False,
            )
        )
    lease = dry(http, bob, stage="conveyor.demo.sync", payload={"user": tag, "note": "n"}).json()
    assert lease["would_run_now"] is False and [r["code"] for r in lease["reasons"]] == ["lease_held"]
    assert lease["reasons"][0]["job_id"] is None
    assert count(platform) == rows


def test_rate_limit_and_concurrency_as_redis_holds_them_now(platform: Any, token: Token, tag: str) -> None:
    """The two best-effort reasons read the keys a worker's admission writes: a slot taken
    by a running job fills a cap of one, a token taken empties a bucket of one."""
    from conveyor.settings import RateLimit, StageOverride
    from conveyor.worker.admission import Admission

    stage = "conveyor.demo.square"
    settings = platform.settings.model_copy(
        update={
            "key_prefix": f"dry{tag}:",
            "rate_limits": {"demo": RateLimit(rate=0.01, burst=1)},
            "stages": {stage: StageOverride(concurrency=1)},
        }
    )
    c = conveyor.Client(settings)
    try:
        admission = Admission(
            lambda: c.connections.redis, key_prefix=settings.key_prefix, slot_ttl=30, busy_wait=1
        )
        with TestClient(create_app(c)) as api:
            secret = token(f"alice-{tag}")
            assert codes(dry(api, secret)) == []
            running = admission.check(queue="demo", rate=None, stage=stage, concurrency=1, job_id="running")
            assert running.slot is not None
            assert codes(dry(api, secret)) == ["concurrency"]
            admission.release(running.slot)
            assert codes(dry(api, secret)) == []
            assert (
                admission.check(
                    queue="demo",
                    rate=RateLimit(rate=0.01, burst=1),
                    stage=stage,
                    concurrency=None,
                    job_id="x",
                ).reason
                is None
            )
            answer = dry(api, secret).json()
            assert [r["code"] for r in answer["reasons"]] == ["rate_limited"]
            assert (
                answer["best_effort"] == ["rate_limited", "concurrency"] and answer["would_run_now"] is False
            )
    finally:
        c.close()


def test_on_sqlite_times_are_compared_and_answered_in_utc(on_sqlite: Any, tag: str) -> None:
    from conveyor.client import registry
    from conveyor.web import tokens

    registry.write(on_sqlite.engine, on_sqlite.stages.values())
    secret = tokens.create(on_sqlite.engine, owner=f"a{tag}", scopes=("submit",)).secret
    c = conveyor.connect(database_url=on_sqlite.settings.database_url, redis_url=on_sqlite.settings.redis_url)
    try:
        with TestClient(create_app(c)) as api:
            later = dry(api, secret, run_at="2030-01-01T00:00:00Z").json()
            assert [r["code"] for r in later["reasons"]] == ["delayed"]
            assert later["reasons"][0]["until"].startswith("2030-01-01T00:00:00") and (
                later["reasons"][0]["until"].endswith(("Z", "+00:00"))
            )
            assert codes(dry(api, secret, run_at="2001-01-01T00:00:00Z")) == []
            delayed = dry(api, secret, delay=30).json()["reasons"][0]["until"]
            assert delayed.endswith(("Z", "+00:00"))
    finally:
        c.close()
