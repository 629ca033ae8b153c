"""``conveyor.connect()``: an app with no stage code submits by name, follows the job, reads
the DLQ; it is refused with a clear message for a stage or payload the workers would not
run."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.orm import Session

import conveyor
from conveyor.client import registry
from conveyor.errors import PayloadInvalid, UnknownStage
from conveyor.store.db import schema as s
from tests.helpers import effect_count

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client(platform: Any, worker: Any) -> Iterator[conveyor.Client]:
    registry.write(platform.engine, platform.stages.values())  # as `conveyor db upgrade` does
    c = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    yield c
    c.close()


def test_submit_by_name_then_wait_and_read_the_result(client: conveyor.Client) -> None:
    job = client.submit("conveyor.demo.square", {"n": 7})
    assert job.wait(30) == s.SUCCEEDED
    assert job.result == {"n": 49}
    events, cursor = job.events()
    assert events[0].topic == "job.submitted" and "job.succeeded" in [e.topic for e in events]
    assert job.events(since=cursor)[0] == []
    assert client.job(job.id).status() == s.SUCCEEDED
    assert job.row()["celery_task_id"] == job.id  # published by the client, not the relay


def test_an_unknown_stage_lists_close_names(client: conveyor.Client) -> None:
    with pytest.raises(UnknownStage, match=r"conveyor\.demo\.square"):
        client.submit("conveyor.demo.sqare", {"n": 7})


def test_an_invalid_payload_names_the_field(client: conveyor.Client) -> None:
    with pytest.raises(PayloadInvalid, match=r"\bn\b"):
        client.submit("conveyor.demo.square", {"n": "seven"})
    with pytest.raises(PayloadInvalid, match=r"\bn\b"):
        client.submit("conveyor.demo.square", {})


def test_dedup_and_idempotency_keys_as_the_platform_applies_them(
    client: conveyor.Client, platform: Any, tag: str
) -> None:
    first = client.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-1", "sleep": 1})
    again = client.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-2"})
    from_platform = platform.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-3"})
    assert again.id == first.id and again.deduplicated
    assert from_platform.id == first.id
    key = f"{tag}-order"
    one = client.submit("conveyor.demo.effect", {"note": key}, idempotency_key=key)
    two = client.submit("conveyor.demo.effect", {"note": key}, idempotency_key=key)
    assert two.id == one.id and two.deduplicated
    assert one.wait(30) == s.SUCCEEDED and first.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=key) == 1


def test_the_job_joins_the_callers_transaction(client: conveyor.Client, platform: Any, tag: str) -> None:
    with Session(platform.engine) as session:
        job = client.submit("conveyor.demo.effect", {"note": tag}, session=session)
        session.rollback()
    with pytest.raises(LookupError):
        job.row()
    with Session(platform.engine) as session:
        job = client.submit("conveyor.demo.effect", {"note": tag}, session=session)
        session.commit()
    assert job.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=tag) == 1


def test_cancel_and_the_dead_letter_queue(client: conveyor.Client, tag: str) -> None:
    later = client.submit("conveyor.demo.effect", {"note": tag}, delay=60)
    assert client.cancel(later.id, reason="changed my mind") == s.CANCELLED
    broken = client.submit("conveyor.demo.broken", {"n": 3})
    assert broken.wait(30) == s.DEAD
    entries = client.dlq.list(stage="conveyor.demo.broken").items
    entry = next(e for e in entries if e["job_id"] == broken.id)
    assert client.dlq.show(entry["id"]) is not None


def test_the_async_client(platform: Any, worker: Any) -> None:
    async def main() -> tuple[str, Any, bool]:
        client = conveyor.AsyncClient(
            database_url=platform.settings.database_url, redis_url=platform.settings.redis_url
        )
        job = await client.submit("conveyor.demo.square", {"n": 5})
        status = await job.wait(30)
        result = await job.result
        events, _ = await job.events()
        page = await client.dlq.list(stage="conveyor.demo.square")
        await client.close()
        return status, result, events[0].topic == "job.submitted" and page.total >= 0

    assert asyncio.run(main()) == (s.SUCCEEDED, {"n": 25}, True)


def test_redis_away_leaves_submit_and_wait_to_postgres(platform: Any, worker: Any) -> None:
    """A client whose Redis does not answer still submits (the relay publishes) and waits
    (polling Postgres), with no Redis error reaching the app."""
    client = conveyor.connect(database_url=platform.settings.database_url, redis_url="redis://127.0.0.1:1/0")
    job = client.submit("conveyor.demo.square", {"n": 4})
    assert job.row()["status"] == s.QUEUED
    platform.republish_if_queued(job.id)  # the workers' relay would, once it sees Redis
    assert job.wait(30) == s.SUCCEEDED and job.result == {"n": 16}
    client.close()


def test_errors_are_conveyors(platform: Any) -> None:
    client = conveyor.connect(
        database_url="postgresql://postgres@127.0.0.1:1/none", redis_url="redis://127.0.0.1:1/0"
    )
    with pytest.raises(conveyor.SubmitFailed, match="nothing was recorded"):
        client.submit("conveyor.demo.square", {"n": 1})
    ok = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    with pytest.raises(PayloadInvalid, match="expected an object"):
        ok.submit("conveyor.demo.square", "7")  # type: ignore[arg-type]
    big = "x" * (platform.settings.max_payload_bytes + 1)
    with pytest.raises(conveyor.PayloadTooLarge, match="max_payload_bytes"):
        ok.submit("conveyor.demo.square", {"n": 1, "blob": big})
