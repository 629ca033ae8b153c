"""A stage's ``on_expired`` hook runs in the transaction that expires its job, wherever it
expires (the reconciler's sweep, the claim that finds it late); a stage's ``kwargsrepr`` is
what its messages show of the payload (Flower), also when a client without its code
publishes. Real Postgres and Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import before_task_publish
from pydantic import BaseModel
from sqlalchemy import update

import conveyor
from conveyor.client import registry
from conveyor.delivery.broker import MASKED
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now_plus
from conveyor.upkeep.reconciler import TickReport
from tests.helpers import database_now, dead_letter_for, job_row, module_stages

pytestmark = pytest.mark.timeout(120)


class Note(BaseModel):
    ref: str
    secret_word: str = ""


def _on_expired(conn: Any, payload: Any) -> None:
    # Written through the expiring transaction: it commits with the expiry or not at all.
    conn.execute(update(s.jobs).where(s.jobs.c.id == payload["ref"]).values(label="expired-hook"))


def _broken_hook(conn: Any, payload: Any) -> None:
    raise RuntimeError("the hook itself fails")


def noop(ctx: Any, p: Note) -> None:
    return None


@pytest.fixture(scope="module")
def declared(platform: Any) -> Iterator[Any]:
    found = {
        "hooked": platform.stage(
            "conveyor.expiry.hooked", payload=Note, queue="demo", on_expired=_on_expired
        )(noop),
        "broken": platform.stage(
            "conveyor.expiry.broken", payload=Note, queue="demo", on_expired=_broken_hook
        )(noop),
        "masked": platform.stage(
            "conveyor.expiry.masked",
            payload=Note,
            queue="demo",
            kwargsrepr=lambda p: f"{{'ref': {p['ref']!r}}}",
        )(noop),
    }
    with module_stages(platform, "conveyor.expiry.", found) as stages:
        registry.write(platform.engine, [platform.stages[t.name] for t in found.values()])
        yield stages


def _expiring(platform: Any, stage: str) -> str:
    job_id = str(uuid.uuid4())
    # Due in an hour, expiring at once: nothing runs it before it expires.
    platform.submit(stage, {"ref": job_id}, job_id=job_id, delay=3600, expires_in=0.05)
    time.sleep(0.1)
    return job_id


def test_the_sweep_runs_the_hook_in_its_transaction(platform: Any, declared: Any) -> None:
    job_id = _expiring(platform, "conveyor.expiry.hooked")
    with platform.engine.begin() as conn:
        platform.relay().reconciler.reconcile(conn, TickReport())
    row = job_row(platform, job_id)
    assert row["status"] == s.EXPIRED and row["label"] == "expired-hook"


def test_the_claim_that_finds_it_expired_runs_the_hook(platform: Any, declared: Any) -> None:
    job_id = _expiring(platform, "conveyor.expiry.hooked")
    with platform.engine.begin() as conn:
        claim = platform.store.claim(conn, job_id, owner="test/1", task_id=str(uuid.uuid4()))
    assert claim.job is not None and claim.job["status"] == s.EXPIRED
    assert job_row(platform, job_id)["label"] == "expired-hook"


def test_a_failing_hook_never_undoes_the_expiry(platform: Any, declared: Any) -> None:
    job_id = _expiring(platform, "conveyor.expiry.broken")
    with platform.engine.begin() as conn:
        platform.relay().reconciler.reconcile(conn, TickReport())
    assert job_row(platform, job_id)["status"] == s.EXPIRED


@pytest.fixture
def published() -> Iterator[dict[str, str]]:
    seen: dict[str, str] = {}

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if headers and headers.get("conveyor_job_id"):
            seen[headers["conveyor_job_id"]] = headers.get("kwargsrepr")

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


def test_a_stages_kwargsrepr_is_what_its_messages_show(
    platform: Any, declared: Any, published: dict[str, str]
) -> None:
    job = platform.submit("conveyor.expiry.masked", {"ref": "r-1", "secret_word": "swordfish"})
    platform.cancel(job.id)
    assert published[job.id] == "{'ref': 'r-1'}"


def test_a_client_without_the_code_publishes_it_masked(
    platform: Any, declared: Any, published: dict[str, str]
) -> None:
    client = conveyor.connect(
        database_url=platform.settings.database_url, redis_url=platform.settings.redis_url
    )
    try:
        job = client.submit("conveyor.expiry.masked", {"ref": "r-2", "secret_word": "swordfish"})
        platform.cancel(job.id)
    finally:
        client.close()
    assert published[job.id] == MASKED


def test_a_dlq_retry_gives_an_expiring_job_its_window_again(platform: Any, worker: Any) -> None:
    """Last in this module: the tests above need no worker running."""
    job = platform.submit("conveyor.demo.broken", {"n": 13}, expires_in=600)
    assert job.wait(30) == s.DEAD
    with platform.engine.begin() as conn:  # as if its window had passed while it lay dead
        past = update(s.jobs).where(s.jobs.c.id == job.id)
        conn.execute(past.values(expires_at=db_now_plus(-1), created_at=db_now_plus(-601)))
    entry = dead_letter_for(platform, job.id)
    assert platform.dlq.retry(entry["id"], by="test") == job.id
    row = job_row(platform, job.id)
    assert 590 <= (row["expires_at"] - database_now(platform)).total_seconds() <= 601
    assert job.wait(30) == s.DEAD  # it ran again (and failed again), not expired
    assert row["status"] != s.EXPIRED
