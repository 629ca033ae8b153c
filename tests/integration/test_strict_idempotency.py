"""A caller's own job id, and strict idempotency: a submit naming an existing job returns
it, unless the stage is strict and the request is another one (another stage, another
payload): then IdempotencyConflict, and nothing is recorded. Real Postgres and Redis; the
platform, the by-name client, a caller's session and the HTTP API."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import conveyor
from conveyor.client import registry
from conveyor.errors import IdempotencyConflict, JobIdInvalid
from conveyor.store.db import schema as s
from conveyor.web import create_app, tokens
from tests.helpers import job_row, module_stages
from tests.integration.http_support import auth, problem

pytestmark = pytest.mark.timeout(120)


class Order(BaseModel):
    order_id: str
    amount: int
    note: str = ""
    request_id: str = ""  # a correlation id: another one is the same request


def ship(ctx: Any, p: Order) -> dict[str, Any]:
    return {"shipped": p.order_id}


def loose(ctx: Any, p: Order) -> dict[str, Any]:
    return {"loose": p.order_id}


@pytest.fixture(scope="module")
def declared(platform: Any) -> Iterator[Any]:
    found = {
        "ship": platform.stage(
            "conveyor.strict.ship",
            payload=Order,
            queue="demo",
            idempotency="strict",
            idempotency_ignore=("request_id",),
        )(ship),
        "loose": platform.stage("conveyor.strict.loose", payload=Order, queue="demo")(loose),
    }
    with module_stages(platform, "conveyor.strict.", found) as stages:
        registry.write(platform.engine, [platform.stages[t.name] for t in found.values()])
        yield stages


@pytest.fixture(scope="module")
def client(platform: Any, declared: Any) -> Iterator[conveyor.Client]:
    c = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    yield c
    c.close()


def _rows(platform: Any, tag: str) -> int:
    with platform.engine.connect() as conn:
        q = select(func.count()).select_from(s.jobs).where(s.jobs.c.payload["order_id"].as_string() == tag)
        return int(conn.execute(q).scalar_one())


def test_a_job_id_of_ones_own_is_the_jobs_id_and_returns_it_in_any_state(
    platform: Any, declared: Any
) -> None:
    job_id = str(uuid.uuid4())
    first = platform.submit(
        "conveyor.strict.loose", {"order_id": job_id, "amount": 1}, job_id=job_id, delay=3600
    )
    assert first.id == job_id and not first.deduplicated
    again = platform.submit("conveyor.strict.loose", {"order_id": job_id, "amount": 2}, job_id=job_id)
    assert again.id == job_id and again.deduplicated  # not strict: whatever the payload
    platform.cancel(job_id)
    after = platform.submit("conveyor.strict.loose", {"order_id": job_id, "amount": 1}, job_id=job_id)
    assert after.id == job_id and after.deduplicated and after.status() == s.CANCELLED
    assert _rows(platform, job_id) == 1


@pytest.mark.parametrize("bad", ["", "x" * 37, "has space", "semi;colon", "ünïcode", "a\x00b"])
def test_a_job_id_that_cannot_be_one_is_refused_before_anything_is_written(
    platform: Any, declared: Any, bad: str, tag: str
) -> None:
    with pytest.raises(JobIdInvalid) as caught:
        platform.submit("conveyor.strict.loose", {"order_id": tag, "amount": 1}, job_id=bad)
    assert bad not in str(caught.value) or bad == ""
    assert _rows(platform, tag) == 0


def test_strict_returns_the_same_request_and_refuses_another(platform: Any, declared: Any) -> None:
    job_id = str(uuid.uuid4())
    order = {"order_id": job_id, "amount": 5, "request_id": "r1"}
    first = platform.submit("conveyor.strict.ship", order, job_id=job_id, delay=3600)
    # Another correlation id is an ignored field: the same request.
    same = platform.submit("conveyor.strict.ship", {**order, "request_id": "r2"}, job_id=job_id)
    assert same.id == first.id and same.deduplicated
    with pytest.raises(IdempotencyConflict) as caught:
        platform.submit("conveyor.strict.ship", {**order, "amount": 6}, job_id=job_id)
    assert caught.value.job_id == job_id
    message = str(caught.value)
    assert "conflict" in message and "amount" in message and "6" not in message.replace(job_id, "")
    assert job_row(platform, job_id)["payload"]["amount"] == 5
    assert _rows(platform, job_id) == 1


def test_strict_refuses_a_job_id_of_another_stage(platform: Any, declared: Any) -> None:
    job_id = str(uuid.uuid4())
    order = {"order_id": job_id, "amount": 5}
    platform.submit("conveyor.strict.loose", order, job_id=job_id, delay=3600)
    with pytest.raises(IdempotencyConflict, match=r"conveyor\.strict\.loose"):
        platform.submit("conveyor.strict.ship", order, job_id=job_id)


def test_strict_applies_to_idempotency_keys_too(platform: Any, declared: Any, tag: str) -> None:
    first = platform.submit(
        "conveyor.strict.ship", {"order_id": tag, "amount": 1}, idempotency_key=tag, delay=3600
    )
    assert (
        platform.submit("conveyor.strict.ship", {"order_id": tag, "amount": 1}, idempotency_key=tag).id
        == first.id
    )
    with pytest.raises(IdempotencyConflict):
        platform.submit("conveyor.strict.ship", {"order_id": tag, "amount": 2}, idempotency_key=tag)


def test_the_by_name_client_applies_the_registered_rule(
    platform: Any, declared: Any, client: conveyor.Client
) -> None:
    job_id = str(uuid.uuid4())
    # Recorded by the deployment (the model fills the defaults), resubmitted by name without them.
    platform.submit("conveyor.strict.ship", {"order_id": job_id, "amount": 3}, job_id=job_id, delay=3600)
    same = client.submit("conveyor.strict.ship", {"order_id": job_id, "amount": 3}, job_id=job_id)
    assert same.id == job_id and same.deduplicated
    with pytest.raises(IdempotencyConflict):
        client.submit("conveyor.strict.ship", {"order_id": job_id, "amount": 3, "note": "x"}, job_id=job_id)
    assert _rows(platform, job_id) == 1


def test_a_conflict_in_the_callers_session_leaves_its_transaction_usable(
    platform: Any, declared: Any
) -> None:
    job_id = str(uuid.uuid4())
    platform.submit("conveyor.strict.ship", {"order_id": job_id, "amount": 1}, job_id=job_id, delay=3600)
    with Session(platform.engine) as session:
        with pytest.raises(IdempotencyConflict):
            platform.submit(
                "conveyor.strict.ship", {"order_id": job_id, "amount": 9}, job_id=job_id, session=session
            )
        other = str(uuid.uuid4())
        platform.submit(
            "conveyor.strict.ship",
            {"order_id": other, "amount": 1},
            job_id=other,
            session=session,
            delay=3600,
        )
        session.commit()
    assert job_row(platform, other) is not None and _rows(platform, job_id) == 1


def test_http_job_id_answers_201_200_409_and_422(
    platform: Any, declared: Any, client: conveyor.Client
) -> None:
    secret = tokens.create(platform.engine, owner="strict-http", scopes=["submit", "read"]).secret
    other = tokens.create(platform.engine, owner="strict-other", scopes=["submit", "read"]).secret
    job_id = str(uuid.uuid4())
    body = {"stage": "conveyor.strict.ship", "payload": {"order_id": job_id, "amount": 1}, "job_id": job_id}
    with TestClient(create_app(client)) as http:
        made = http.post("/jobs", json={**body, "delay": 3600}, headers=auth(secret))
        assert made.status_code == 201 and made.json()["id"] == job_id
        again = http.post("/jobs", json=body, headers=auth(secret))
        assert again.status_code == 200 and again.json()["deduplicated"] is True
        changed = {**body, "payload": {"order_id": job_id, "amount": 2}}
        conflict = problem(
            http.post("/jobs", json=changed, headers=auth(secret)), 409, "idempotency-conflict"
        )
        assert conflict["job_id"] == job_id and "amount" in conflict["detail"]
        # Another owner learns neither the stage nor the payload of a job it cannot see.
        hidden = problem(
            http.post("/jobs", json=changed, headers=auth(other)), 409, "duplicate-of-another-owner"
        )
        assert "job_id" not in hidden
        problem(http.post("/jobs", json={**body, "job_id": "x" * 37}, headers=auth(secret)), 422)
    assert _rows(platform, job_id) == 1


def test_a_stage_ignoring_a_field_it_does_not_have_is_refused(platform: Any) -> None:
    with pytest.raises(conveyor.ConfigurationError, match="idempotency_ignore"):
        platform.stage("conveyor.strict.bad", payload=Order, queue="demo", idempotency_ignore=("nope",))(ship)
