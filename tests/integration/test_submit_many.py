"""``submit_many()``: many jobs in a few transactions and one pipelined publish per batch,
from the platform and from a client, with idempotency keys and dedup answered as
``submit()`` answers them, nothing recorded for an invalid payload, and Redis optional."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

import conveyor
from conveyor.client import registry
from conveyor.delivery.broker import Broker
from conveyor.delivery.embedded import free_port
from conveyor.delivery.procs import service_env
from conveyor.errors import PayloadInvalid
from conveyor.store.db import schema as s
from conveyor.store.db.schema import job_events, jobs
from tests.helpers import effect_count, eventually

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(platform: Any, worker: Any) -> Iterator[conveyor.Client]:
    registry.write(platform.engine, platform.stages.values())  # as `conveyor db upgrade` does
    c = conveyor.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    yield c
    c.close()


def _statuses(platform: Any, ids: Sequence[str]) -> dict[str, int]:
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(jobs.c.status, func.count()).where(jobs.c.id.in_(list(ids))).group_by(jobs.c.status)
        )
        return {str(k): int(v) for k, v in rows}


def _all_succeeded(platform: Any, ids: Sequence[str]) -> bool:
    return _statuses(platform, ids) == {s.SUCCEEDED: len(set(ids))}


def _published_by_relay(platform: Any, ids: Sequence[str]) -> bool:
    """Every job's message was sent by the relay (a fresh task id), none by the call."""
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs.c.id, jobs.c.celery_task_id).where(jobs.c.id.in_(list(ids)))))
    return len(rows) == len(ids) and all(r.celery_task_id not in (None, r.id) for r in rows)


def _job_count(platform: Any) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())


def test_a_batch_of_hundreds_runs_through_a_worker(platform: Any, worker: Any) -> None:
    handles = platform.submit_many("conveyor.demo.noop", [{"n": i} for i in range(300)], batch_size=128)
    ids = [h.id for h in handles]
    assert len(set(ids)) == 300 and not any(h.deduplicated for h in handles)
    with platform.engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(select(jobs).where(jobs.c.id.in_(ids))).mappings()}
        submitted = conn.execute(
            select(func.count())
            .select_from(job_events)
            .where(job_events.c.job_id.in_(ids), job_events.c.topic == "job.submitted")
        ).scalar_one()
    assert len(rows) == 300 and submitted == 300  # all committed when submit_many returned
    assert [rows[i]["payload"] for i in ids] == [{"n": i} for i in range(300)]  # in order
    for job_id, row in rows.items():
        assert row["options"] == {s.IGNORE_RESULT: True}
        assert row["celery_task_id"] == job_id and row["broker_epoch"]  # published by the call
    eventually(lambda: _all_succeeded(platform, ids), timeout=120)
    assert handles[7].result == {"n": 7}


def test_idempotency_keys_within_one_call_and_against_earlier_jobs(
    platform: Any, worker: Any, tag: str
) -> None:
    earlier = platform.submit("conveyor.demo.effect", {"note": f"{tag}-a"}, idempotency_key=f"{tag}-a")
    notes = ["a", "b", "c", "b"]
    handles = platform.submit_many(
        "conveyor.demo.effect",
        [{"note": f"{tag}-{n}"} for n in notes],
        idempotency_keys=[f"{tag}-{n}" for n in notes],
        batch_size=2,
    )
    assert handles[0].id == earlier.id and handles[0].deduplicated
    assert not handles[1].deduplicated and not handles[2].deduplicated
    assert handles[3].id == handles[1].id and handles[3].deduplicated
    again = platform.submit_many(
        "conveyor.demo.effect",
        [{"note": f"{tag}-c"}, {"note": f"{tag}-d"}],
        idempotency_keys=[f"{tag}-c", None],
    )
    assert again[0].id == handles[2].id and again[0].deduplicated and not again[1].deduplicated
    ids = [earlier.id, handles[1].id, handles[2].id, again[1].id]
    eventually(lambda: _all_succeeded(platform, ids), timeout=60)
    for note in ("a", "b", "c"):
        assert effect_count(platform, note=f"{tag}-{note}") == 1


def test_a_dedup_policy_answers_as_submit_does(platform: Any, worker: Any, tag: str) -> None:
    first = platform.submit("conveyor.demo.keyed", {"user": tag, "note": f"{tag}-0", "sleep": 1})
    other = f"{tag}-other"
    handles = platform.submit_many(
        "conveyor.demo.keyed",
        [
            {"user": tag, "note": f"{tag}-1"},
            {"user": other, "note": f"{tag}-2"},
            {"user": other, "note": f"{tag}-3"},
        ],
    )
    assert handles[0].id == first.id and handles[0].deduplicated
    assert not handles[1].deduplicated
    assert handles[2].id == handles[1].id and handles[2].deduplicated
    eventually(lambda: _all_succeeded(platform, [first.id, handles[1].id]), timeout=60)
    assert effect_count(platform, note=f"{tag}-0") == 1 and effect_count(platform, note=f"{tag}-2") == 1
    assert effect_count(platform, note=f"{tag}-1") == 0 and effect_count(platform, note=f"{tag}-3") == 0
    # dedup=False turns the policy off: the batch path records both.
    off = platform.submit_many(
        "conveyor.demo.keyed",
        [{"user": tag, "note": f"{tag}-4"}, {"user": tag, "note": f"{tag}-5"}],
        dedup=False,
    )
    assert off[0].id != off[1].id and not off[1].deduplicated
    eventually(lambda: _all_succeeded(platform, [h.id for h in off]), timeout=60)


def test_an_invalid_payload_in_the_middle_records_nothing(platform: Any, client: conveyor.Client) -> None:
    payloads: list[Any] = [{"n": i} for i in range(10)]
    payloads[5] = {"n": "five"}
    before = _job_count(platform)
    with pytest.raises(PayloadInvalid, match=r"payloads\[5\].*\bn\b"):
        platform.submit_many("conveyor.demo.noop", payloads)
    with pytest.raises(PayloadInvalid, match=r"payloads\[5\].*\bn\b"):
        client.submit_many("conveyor.demo.noop", payloads)
    payloads[5] = "not a mapping"
    with pytest.raises(PayloadInvalid, match=r"payloads\[5\]"):
        client.submit_many("conveyor.demo.noop", payloads)
    assert _job_count(platform) == before


def test_the_clients_submit_many_runs_without_the_worker_side(platform: Any, client: conveyor.Client) -> None:
    script = """
import json, sys
import conveyor
c = conveyor.connect()
handles = c.submit_many("conveyor.demo.noop", [{"n": i} for i in range(120)], batch_size=50)
again = c.submit_many("conveyor.demo.noop", [{"n": 1}], idempotency_keys=[sys.argv[1]])
twice = c.submit_many("conveyor.demo.noop", [{"n": 1}], idempotency_keys=[sys.argv[1]])
worker = [m for m in sys.modules if m.startswith(("conveyor.worker", "conveyor.upkeep", "conveyor.platform"))]
print(json.dumps({"ids": [h.id for h in handles], "worker": worker,
                  "keyed": [again[0].id, twice[0].id, twice[0].deduplicated]}))
"""
    key = f"key-{free_port()}-{id(client)}"
    done = subprocess.run(
        [sys.executable, "-c", script, key],
        env=service_env(platform.settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["worker"] == []
    first, second, deduplicated = out["keyed"]
    assert first == second and deduplicated
    ids = [*out["ids"], first]
    eventually(lambda: _all_succeeded(platform, ids), timeout=120)
    published = client.job(out["ids"][0]).row()
    assert published["celery_task_id"] == published["id"]  # published by the client itself


def test_with_redis_unreachable_the_jobs_are_recorded_and_the_relay_publishes_them(
    platform: Any, worker: Any, tag: str
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    away = conveyor.connect(database_url=platform.settings.database_url, redis_url=dead)
    try:
        handles = away.submit_many("conveyor.demo.effect", [{"note": f"{tag}-c{i}"} for i in range(40)])
    finally:
        away.close()
    script = """
import json, sys
from config.celery_app import platform
handles = platform.submit_many("conveyor.demo.effect", [{"note": f"{sys.argv[1]}-p{i}"} for i in range(40)])
print(json.dumps([h.id for h in handles]))
"""
    settings = platform.settings.with_urls(dead, platform.settings.database_url)
    done = subprocess.run(
        [sys.executable, "-c", script, tag],
        env=service_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ids = [h.id for h in handles] + json.loads(done.stdout.strip().splitlines()[-1])
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs.c.status, jobs.c.published_at).where(jobs.c.id.in_(ids))))
    assert len(rows) == 80  # recorded without Redis; left for the relay (or already taken by it)
    eventually(lambda: _all_succeeded(platform, ids), timeout=120)
    assert _published_by_relay(platform, ids)
    for i in range(40):
        assert effect_count(platform, note=f"{tag}-c{i}") == 1
        assert effect_count(platform, note=f"{tag}-p{i}") == 1


def test_a_failed_publish_leaves_the_batch_to_the_relay(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(self: Broker, jobs: Any, **_: Any) -> None:
        raise ConnectionError("the pipeline broke")

    monkeypatch.setattr(Broker, "publish_many", fail)
    try:
        handles = platform.submit_many("conveyor.demo.effect", [{"note": f"{tag}-{i}"} for i in range(30)])
    finally:
        monkeypatch.undo()
        platform.fast.reset()  # the failure tripped the submit breaker: close it for later tests
    ids = [h.id for h in handles]
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs.c.status, jobs.c.published_at).where(jobs.c.id.in_(ids))))
    assert len(rows) == 30
    assert all(r.published_at is None for r in rows if r.status == s.QUEUED)  # marked for the relay
    eventually(lambda: _all_succeeded(platform, ids), timeout=120)
    assert _published_by_relay(platform, ids)
    for i in range(30):
        assert effect_count(platform, note=f"{tag}-{i}") == 1


def test_on_sqlite(on_sqlite: Any, tag: str) -> None:
    platform = on_sqlite
    handles = platform.submit_many(
        "conveyor.demo.noop",
        [{"n": i} for i in range(25)],
        idempotency_keys=[f"{tag}-{i % 20}" for i in range(25)],
        batch_size=10,
    )
    assert [h.deduplicated for h in handles] == [False] * 20 + [True] * 5
    assert [h.id for h in handles[20:]] == [h.id for h in handles[:5]]
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs).where(jobs.c.id.in_([h.id for h in handles]))).mappings())
        events = conn.execute(
            select(func.count()).select_from(job_events).where(job_events.c.topic == "job.submitted")
        ).scalar_one()
    assert len(rows) == 20 and events == 20
    # (The module's worker shares the platform, so it may be running them already.)
    assert all(r["options"] == {s.IGNORE_RESULT: True} for r in rows)


def test_a_failed_commit_sends_nothing_and_raises_submit_failed(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kombu.transport.redis

    import conveyor.client.bulk
    from conveyor.errors import SubmitFailed

    real_insert, calls = conveyor.client.bulk.insert_batch, []

    def insert_then_fail(conn: Any, store: Any, rows: Any) -> set[str]:
        calls.append(rows.count)
        if len(calls) == 2:  # the second batch's commit fails
            raise DBAPIError("INSERT", {}, RuntimeError("the database went away"))
        return real_insert(conn, store, rows)

    flushed: list[int] = []
    # kombu < 5.7 (the floor) has no publish batch: it sends one message at a time, and the
    # jobs that ran (below) say what was sent.
    batches = getattr(kombu.transport.redis, "PublishBatch", None)
    if platform.settings.broker_is_amqp():
        batches = None  # RabbitMQ: each message confirmed on its own, no batch
    if batches is not None:
        real_flush = batches.flush

        def counting_flush(self: Any) -> None:
            flushed.append(self._buffered)
            real_flush(self)

        monkeypatch.setattr(batches, "flush", counting_flush)
    monkeypatch.setattr(conveyor.client.bulk, "insert_batch", insert_then_fail)
    with pytest.raises(SubmitFailed, match=r"10 of 30 were recorded"):
        platform.submit_many(
            "conveyor.demo.effect", [{"note": f"{tag}-{i}"} for i in range(30)], batch_size=10
        )
    monkeypatch.undo()
    assert calls == [10, 10]  # the third batch never started
    if batches is not None:
        assert [n for n in flushed if n] == [10]  # only the committed batch was sent
    eventually(lambda: sum(effect_count(platform, note=f"{tag}-{i}") for i in range(30)) == 10, timeout=60)
    assert all(effect_count(platform, note=f"{tag}-{i}") == (1 if i < 10 else 0) for i in range(30))


def test_delay_and_owner_as_submit_records_them(platform: Any, tag: str) -> None:
    from conveyor.client.owners import owned_key

    keys = [f"{tag}-k{i}" for i in range(3)]
    notes = [{"note": f"{tag}-d{i}"} for i in range(3)]
    acme = platform.submit_many("conveyor.demo.effect", notes, delay=60, owner="acme", idempotency_keys=keys)
    other = platform.submit_many(
        "conveyor.demo.effect", notes, delay=60, owner="other", idempotency_keys=keys
    )
    again = platform.submit_many("conveyor.demo.effect", notes, delay=60, owner="acme", idempotency_keys=keys)
    assert [h.id for h in again] == [h.id for h in acme] and all(h.deduplicated for h in again)
    assert not any(h.deduplicated for h in other) and {h.id for h in other}.isdisjoint(h.id for h in acme)
    try:
        with platform.engine.connect() as conn:
            rows = {
                r["id"]: r
                for r in conn.execute(select(jobs).where(jobs.c.id.in_([h.id for h in acme]))).mappings()
            }
        for handle, key in zip(acme, keys, strict=True):
            row = rows[handle.id]
            assert row["owner"] == "acme" and row["idempotency_key"] == owned_key("acme", key)
            assert row["published_at"] is None and row["broker_epoch"] is None  # the relay's, when due
            assert (row["run_at"] - row["created_at"]).total_seconds() > 55
    finally:
        for handle in [*acme, *other]:
            platform.cancel(handle.id)


@pytest.mark.parametrize("path", ["kombu_without_batches", "task_sent_events"])
def test_the_one_by_one_publish_paths(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    import kombu.messaging

    if path == "kombu_without_batches":  # kombu < 5.7 (the floor, 5.6) has no Producer.batch
        monkeypatch.delattr(kombu.messaging.Producer, "batch", raising=False)
    else:
        monkeypatch.setitem(platform.app.conf, "task_send_sent_event", True)
    handles = platform.submit_many(
        "conveyor.demo.effect", [{"note": f"{tag}-{i}"} for i in range(12)], batch_size=5
    )
    monkeypatch.undo()
    ids = [h.id for h in handles]
    eventually(lambda: _all_succeeded(platform, ids), timeout=60)
    with platform.engine.connect() as conn:
        rows = list(conn.execute(select(jobs.c.id, jobs.c.celery_task_id).where(jobs.c.id.in_(ids))))
    assert all(r.celery_task_id == r.id for r in rows)  # published by the call itself
    assert all(effect_count(platform, note=f"{tag}-{i}") == 1 for i in range(12))
