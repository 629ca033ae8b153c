"""The stage lifecycle against real Redis, Postgres and an in-process worker."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from celery import chain
from sqlalchemy.orm import Session

import tasks.demo as demo
from conveyor.errors import PayloadInvalid
from conveyor.store.db import schema as s
from tests.helpers import dead_letter_for, discarded, effect_count, eventually, job_row, publish_again

pytestmark = pytest.mark.timeout(120)


def test_submit_runs_to_success_and_wait_is_woken(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.square", {"n": 7})
    assert handle.wait(timeout=30) == s.SUCCEEDED
    assert handle.result == {"n": 49}
    topics = [e.topic for e in handle.events()[0]]
    assert topics[0] == "job.submitted" and "job.succeeded" in topics


def test_effect_commits_with_completion_exactly_once(platform: Any, worker: Any, tag: str) -> None:
    handle = platform.submit("conveyor.demo.effect", {"note": tag})
    assert handle.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=tag) == 1


def test_chain_of_stages_each_tracked(platform: Any, worker: Any) -> None:
    result = chain(demo.square_stage.s(n=2), demo.square_stage.s(), demo.square_stage.s()).apply_async()
    # The chain's last link has a canvas-frozen id: its job id.
    last = platform.job(result.id)
    eventually(lambda: job_row(platform, last.id) is not None, timeout=30)
    assert last.wait(30) == s.SUCCEEDED
    assert last.result == {"n": 256}
    assert result.get(timeout=10) == {"n": 256}


def test_transient_failure_retries_then_succeeds(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.flaky", {"n": 1, "fail_times": 2})
    assert handle.wait(30) == s.SUCCEEDED
    row = handle.row()
    assert row["attempts"] == 3
    assert [e.topic for e in handle.events()[0]].count("job.retrying") == 2


def test_permanent_failure_is_dead_lettered_once_with_readable_message(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.broken", {"n": 5})
    assert handle.wait(30) == s.DEAD
    letter = dead_letter_for(platform, handle.id)
    assert letter["error_type"] == "PermanentError"
    assert "record 5 cannot be processed" in letter["message"]
    assert letter["attempts"] == 1 and letter["label"] == "broken 5"


def test_invalid_payload_rejected_at_submit(platform: Any) -> None:
    with pytest.raises(PayloadInvalid, match="n: "):
        platform.submit("conveyor.demo.square", {"n": "not a number"})


def test_delayed_job_runs_no_earlier_than_run_at(platform: Any, worker: Any, tag: str) -> None:
    handle = platform.submit("conveyor.demo.effect", {"note": tag}, delay=1.5)
    assert handle.status() == s.QUEUED and handle.row()["published_at"] is None
    assert handle.wait(30) == s.SUCCEEDED
    row = handle.row()
    assert row["started_at"] >= row["run_at"]


def test_expired_job_never_runs(platform: Any, worker: Any, tag: str) -> None:
    handle = platform.submit("conveyor.demo.effect", {"note": tag}, delay=1.0, expires_in=0.3)
    assert handle.wait(30) == s.EXPIRED
    assert handle.row()["started_at"] is None
    assert effect_count(platform, note=tag) == 0


def test_countdown_lives_in_the_database_not_the_broker(platform: Any, worker: Any, tag: str) -> None:
    result = demo.effect.apply_async(kwargs={"note": tag}, countdown=1.0)
    row = job_row(platform, result.id)
    assert row["published_at"] is None and row["run_at"] > row["created_at"]
    assert platform.job(result.id).wait(30) == s.SUCCEEDED


def test_idempotency_key_returns_existing_job_in_any_state(platform: Any, worker: Any, tag: str) -> None:
    first = platform.submit("conveyor.demo.effect", {"note": tag}, idempotency_key=tag)
    assert first.wait(30) == s.SUCCEEDED
    again = platform.submit("conveyor.demo.effect", {"note": tag}, idempotency_key=tag)
    assert again.id == first.id and again.deduplicated
    assert effect_count(platform, note=tag) == 1


def test_submit_in_caller_transaction_publishes_only_after_commit(
    platform: Any, worker: Any, tag: str
) -> None:
    with Session(platform.engine) as session:
        rolled = platform.submit("conveyor.demo.effect", {"note": tag + "-rb"}, session=session)
        session.rollback()
    assert job_row(platform, rolled.id) is None
    with Session(platform.engine) as session:
        kept = platform.submit("conveyor.demo.effect", {"note": tag}, session=session)
        assert job_row(platform, kept.id) is None  # not visible before commit
        session.commit()
    assert kept.wait(30) == s.SUCCEEDED
    assert effect_count(platform, note=tag) == 1 and effect_count(platform, note=tag + "-rb") == 0


def test_send_task_by_name_is_adopted(platform: Any, worker: Any, tag: str) -> None:
    result = platform.app.send_task("conveyor.demo.effect", kwargs={"note": tag}, queue="demo")
    eventually(lambda: effect_count(platform, note=tag) == 1, timeout=30)
    rows = eventually(
        lambda: [r for r in _jobs_with_origin(platform, result.id) if r["status"] == s.SUCCEEDED]
    )
    assert rows[0]["payload"]["note"] == tag


def test_send_task_with_invalid_payload_goes_to_dlq(platform: Any, worker: Any) -> None:
    result = platform.app.send_task("conveyor.demo.square", kwargs={"n": "seven"}, queue="demo")
    rows = eventually(lambda: _jobs_with_origin(platform, result.id))
    letter = eventually(lambda: dead_letter_for(platform, rows[0]["id"]))
    assert letter["error_type"] == "PayloadInvalid" and "n: " in letter["message"]
    assert "seven" not in letter["message"]


def test_dlq_retry_grants_fresh_budget_and_never_lowers_attempts(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.broken", {"n": 77})
    assert handle.wait(30) == s.DEAD
    entry = dead_letter_for(platform, handle.id)
    assert platform.dlq.retry(entry["id"], by="test") == handle.id
    eventually(lambda: handle.row()["attempts"] == 2 and handle.status() == s.DEAD)
    row = handle.row()
    assert row["max_attempts"] == 1 + platform.stages["conveyor.demo.broken"].max_attempts
    assert dead_letter_for(platform, handle.id)["id"] != entry["id"]
    assert platform.dlq.retry(entry["id"]) is None  # already retried


def test_events_since_cursor_pages_in_order(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.flaky", {"n": 3, "fail_times": 1})
    handle.wait(30)
    seen, cursor = [], None
    while True:
        batch, cursor2 = handle.events(since=cursor)
        if not batch:
            break
        seen += batch
        cursor = cursor2
    assert [e.topic for e in seen] == ["job.submitted", "job.retrying", "job.succeeded"]


def _jobs_with_origin(platform: Any, task_id: str) -> list[Any]:
    from sqlalchemy import select

    from conveyor.store.db.schema import jobs

    with platform.engine.connect() as conn:
        return list(conn.execute(select(jobs).where(jobs.c.origin_task_id == task_id)).mappings())


def test_duplicate_delivery_of_the_same_message_has_one_effect(platform: Any, worker: Any, tag: str) -> None:
    flow = chain(demo.effect.s(note=f"{tag}-a"), demo.effect.si(note=f"{tag}-b")).apply_async()
    head = platform.job(flow.parent.id)
    assert platform.job(flow.id).wait(30) == s.SUCCEEDED
    row = head.row()
    # The very same message again (same task id, same job header, same chain).
    publish_again(platform, row, task_id=row["origin_task_id"])
    eventually(lambda: discarded(platform, head.id))
    assert effect_count(platform, note=f"{tag}-a") == 1
    assert effect_count(platform, note=f"{tag}-b") == 1
    assert platform.job(flow.id).row()["attempts"] == 1


def test_preemptable_stage_cannot_join_a_group(platform: Any) -> None:
    from celery import group

    from conveyor.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="preemptable"):
        group(demo.sync.s(user="u", note="n"), demo.sync.s(user="v", note="n")).apply_async()


def test_cancel_returns_the_final_state_of_a_finished_job(platform: Any, worker: Any) -> None:
    handle = platform.submit("conveyor.demo.square", {"n": 3})
    assert handle.wait(30) == s.SUCCEEDED
    assert handle.cancel(by="test") == s.SUCCEEDED


def test_a_message_whose_job_row_never_committed_is_dropped_saying_so(
    platform: Any, worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="conveyor.runner")
    ghost = str(uuid.uuid4())
    effect = {"stage": "conveyor.demo.effect", "queue": "demo", "payload": {"note": ghost}, "options": {}}
    platform.broker.publish(job_id=ghost, task_id=ghost, **effect)
    eventually(lambda: discarded(platform, ghost) == ["missing"], timeout=30)
    said = eventually(lambda: [r.getMessage() for r in caplog.records if ghost in r.getMessage()], timeout=10)
    assert "never committed" in said[0] and "another database" in said[0], said
