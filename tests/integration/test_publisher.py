"""The publisher family's promises with an in-process worker, real Postgres and Redis and a
Graph-like peer: one post per plan, retries and the dead-letter queue, replay, the first
comment once, edit and cancel before due, blackout windows and refusals."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import func, select

from conveyor.errors import PayloadInvalid
from conveyor.store.db import schema as s
from pipelines.publisher import (
    PostConflict,
    PostNotFound,
    cancel_post,
    check_post,
    edit_post,
    replay_post,
    schedule_post,
    show_post,
)
from pipelines.publisher.peers import GraphPeer
from tasks.publisher import tables as t
from tasks.publisher.models import FIRST_COMMENT_STAGE
from tests.helpers import dead_letter_for, eventually
from tests.integration.publisher_support import (
    children,
    events,
    now,
    plan,
    post_row,
    publisher_settings,
    topics,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def peer() -> Iterator[GraphPeer]:
    with GraphPeer() as graph:
        yield graph


def test_a_facebook_post_is_published_once_and_recorded(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    with publisher_settings(platform, peer):
        done = schedule_post(platform, plan(tag, media=("https://example.test/page",)))
        assert done.status == t.PENDING and not done.existing and done.job_id == done.id
        assert platform.job(done.job_id).wait(30) == s.SUCCEEDED
    [post] = peer.posts(f"acct-{tag}")
    assert post["message"] == f"Hello from {tag}" and post["link"] == "https://example.test/page"
    row = post_row(platform, done.id)
    assert row["status"] == t.COMPLETED and row["remote_id"] == post["id"] and row["attempts"] == 1
    assert "publisher.processing" in topics(platform, done.job_id)
    assert show_post(platform, done.id)["job_status"] == s.SUCCEEDED


def test_an_instagram_post_and_its_first_comment_are_published_once(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    with publisher_settings(platform, peer):
        done = schedule_post(platform, plan(tag, "instagram", first_comment="  First!\n\n#launch "))
        assert platform.job(done.job_id).wait(30) == s.SUCCEEDED
        [child] = eventually(lambda: [c for c in children(platform, done.id) if c["status"] == t.COMPLETED])
    [media] = peer.media(f"acct-{tag}")
    assert post_row(platform, done.id)["remote_id"] == media["id"]
    [comment] = peer.comments(media["id"])
    assert comment["text"] == "First!\n\n#launch" and child["remote_id"] == comment["id"]
    assert child["type"] == t.FIRST_COMMENT


def test_a_first_comment_asked_twice_is_one_comment(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    with publisher_settings(platform, peer):
        done = schedule_post(platform, plan(tag, "instagram", first_comment="Once only"))
        assert platform.job(done.job_id).wait(30) == s.SUCCEEDED
        [child] = eventually(lambda: [c for c in children(platform, done.id) if c["status"] == t.COMPLETED])
        media_id = post_row(platform, done.id)["remote_id"]
        payload = {"post_id": child["id"], "media_id": media_id, "comment_hash": child["idempotency_key"]}
        again = platform.submit(FIRST_COMMENT_STAGE, payload)  # the stage's dedup: the same job
        assert again.deduplicated and again.id == child["job_id"]
        with platform.engine.begin() as conn:  # its record lost: the body runs again, and finds it
            conn.execute(t.posts.update().where(t.posts.c.id == child["id"]).values(status=t.PENDING))
        forced = platform.submit(FIRST_COMMENT_STAGE, payload, dedup=False)
        assert forced.wait(30) == s.SUCCEEDED and forced.result["remote_id"] == child["remote_id"]
    assert [c["text"] for c in peer.comments(media_id)] == ["Once only"]


def test_one_plan_scheduled_fifty_times_at_once_is_one_record_and_one_post(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    at = now() + dt.timedelta(seconds=2)
    results: list[Any] = []
    gate = threading.Barrier(50)

    def schedule() -> None:
        gate.wait()
        results.append(schedule_post(platform, plan(tag, at=at)))

    with publisher_settings(platform, peer):
        threads = [threading.Thread(target=schedule) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len({r.id for r in results}) == 1 and sum(not r.existing for r in results) == 1
        assert platform.job(results[0].job_id).wait(30) == s.SUCCEEDED
    assert len(peer.posts(f"acct-{tag}")) == 1
    with platform.engine.connect() as conn:
        count = conn.execute(
            select(func.count()).select_from(t.posts).where(t.posts.c.brand == f"brand-{tag}")
        )
        assert count.scalar_one() == 1


def test_the_same_plan_from_another_time_zone_is_the_same_post(
    platform: Any, peer: GraphPeer, tag: str
) -> None:
    at = dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)
    rome = at.astimezone(dt.timezone(dt.timedelta(hours=1)))
    with publisher_settings(platform, peer):
        first = schedule_post(platform, plan(tag, at=at))
        again = schedule_post(platform, plan(tag, at=rome.isoformat()))
        assert again.id == first.id and again.existing
        cancel_post(platform, first.id)


def test_a_transient_error_is_retried_and_a_refusal_fails_then_replays(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    with publisher_settings(platform, peer, retry_backoff={"base": 0.2, "factor": 2, "max": 1}):
        peer.fail_next(1, status=500, path_contains=f"acct-{tag}-a")
        retried = schedule_post(platform, plan(tag, account=f"acct-{tag}-a"))
        assert platform.job(retried.job_id).wait(30) == s.SUCCEEDED
        assert post_row(platform, retried.id)["attempts"] == 2 and len(peer.posts(f"acct-{tag}-a")) == 1

        peer.fail_next(1, status=400, code=100, path_contains=f"acct-{tag}-b")
        refused = schedule_post(platform, plan(tag, account=f"acct-{tag}-b"))
        assert platform.job(refused.job_id).wait(30) == s.DEAD
        row = post_row(platform, refused.id)
        assert (
            row["status"] == t.FAILED
            and "400" in row["last_error"]
            and dead_letter_for(platform, refused.job_id)
        )
        replayed = replay_post(platform, refused.id)
        assert replayed["status"] == t.PENDING and replayed["attempts"] == 0
        assert platform.job(refused.job_id).wait(30) == s.SUCCEEDED
    assert len(peer.posts(f"acct-{tag}-b")) == 1
    row = post_row(platform, refused.id)
    assert row["status"] == t.COMPLETED and row["idempotency_key"] == refused.idempotency_key
    with pytest.raises(PostConflict) as conflict:
        edit_post(platform, refused.id, caption="too late")
    assert conflict.value.code == "post-not-pending"


def test_replay_of_a_post_whose_success_was_recorded_publishes_nothing(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    with publisher_settings(platform, peer):
        done = schedule_post(platform, plan(tag))
        assert platform.job(done.job_id).wait(30) == s.SUCCEEDED
        with platform.engine.begin() as conn:  # a success hidden from the status: a remote id kept
            conn.execute(t.posts.update().where(t.posts.c.id == done.id).values(status=t.FAILED))
        shown = replay_post(platform, done.id)
    assert shown["remote_id"] == post_row(platform, done.id)["remote_id"] and shown["status"] == t.FAILED
    assert len(peer.posts(f"acct-{tag}")) == 1


def test_edit_and_cancel_before_due(platform: Any, worker: Any, peer: GraphPeer, tag: str) -> None:
    later = now() + dt.timedelta(hours=1)
    with publisher_settings(platform, peer):
        first = schedule_post(platform, plan(tag, at=later))
        other = schedule_post(platform, plan(tag, at=later, caption="another"))
        with pytest.raises(PostConflict) as taken:
            edit_post(platform, other.id, caption=f"Hello from {tag}")
        assert taken.value.code == "idempotency-key-taken"
        assert post_row(platform, other.id)["caption"] == "another"

        edited = edit_post(
            platform, first.id, caption="Edited {n}", placeholders={"n": 2}, scheduled_at=now()
        )
        assert edited["caption"] == "Edited 2" and edited["idempotency_key"] != first.idempotency_key
        assert platform.job(first.job_id).wait(30) == s.SUCCEEDED
        [post] = peer.posts(f"acct-{tag}")
        assert post["message"] == "Edited 2"

        cancelled = cancel_post(platform, other.id)
        assert cancelled["status"] == t.CANCELLED
        assert platform.job(other.job_id).wait(10) == s.CANCELLED
        with pytest.raises(PostConflict):
            edit_post(platform, other.id, caption="too late")
    with pytest.raises(PostNotFound):
        show_post(platform, "no-such-post")


def test_a_post_due_inside_a_blackout_window_waits_for_its_end(
    platform: Any, worker: Any, peer: GraphPeer, tag: str
) -> None:
    rome = ZoneInfo("Europe/Rome")  # the window in local time; the wait and its end in UTC
    start = now()
    end = start + dt.timedelta(seconds=3)
    window = {
        "name": f"quiet-{tag}",
        "start": start.astimezone(rome).strftime("%H:%M:%S"),
        "end": end.astimezone(rome).strftime("%H:%M:%S"),
        "timezone": "Europe/Rome",
        "brands": [f"brand-{tag}"],
    }
    with publisher_settings(platform, peer, blackout_windows=[window]):
        held = schedule_post(platform, plan(tag))
        free = schedule_post(platform, plan(tag, brand=f"other-{tag}", account=f"other-{tag}"))
        assert platform.job(free.job_id).wait(30) == s.SUCCEEDED
        [parked] = eventually(lambda: events(platform, held.job_id, "job.blackout"))
        assert parked["window"] == f"quiet-{tag}"
        assert dt.datetime.fromisoformat(parked["until"]) == end.replace(microsecond=0)
        assert platform.job(held.job_id).wait(30) == s.SUCCEEDED
    [post] = peer.posts(f"acct-{tag}")
    assert dt.datetime.fromisoformat(post["created_time"].replace("+0000", "+00:00")) >= end.replace(
        microsecond=0
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"channel": "tiktok"}, "channel"),
        ({"caption": "  "}, "caption"),
        ({"channel": "instagram", "media": ()}, "media"),
        ({"scheduled_at": "2030-01-01T09:00:00"}, "scheduled_at"),
        ({"scheduled_at": "next tuesday"}, "scheduled_at"),
        ({"caption": "Hi {name}"}, "placeholders"),
    ],
)
def test_bad_plans_are_refused_naming_the_field(
    platform: Any, peer: GraphPeer, tag: str, changes: dict[str, Any], field: str
) -> None:
    with publisher_settings(platform, peer), pytest.raises(PayloadInvalid, match=f"^{field}"):
        schedule_post(platform, plan(tag, **changes))
    with platform.engine.connect() as conn:
        count = conn.execute(
            select(func.count()).select_from(t.posts).where(t.posts.c.brand == f"brand-{tag}")
        )
        assert count.scalar_one() == 0


def test_an_account_without_a_token_is_refused(platform: Any, peer: GraphPeer, tag: str) -> None:
    with (
        publisher_settings(platform, peer, tokens={"known": "x"}),
        pytest.raises(PayloadInvalid, match=r"^account"),
    ):
        schedule_post(platform, plan(tag))


def test_preview_and_test_insert_nothing(platform: Any, peer: GraphPeer, tag: str) -> None:
    with publisher_settings(platform, peer):
        preview = schedule_post(
            platform, plan(tag, caption="Hi {who}", placeholders={"who": "you"}, preview=True)
        )
        assert preview.preview is not None and preview.preview["caption"] == "Hi you" and preview.id == ""
        checked = check_post(platform, channel="facebook", account=f"acct-{tag}", at=now(), caption="x")
        assert checked["would_run"] and checked["blackout"] is None and checked["idempotency_key"]
    assert peer.requests == []


def test_the_graph_token_is_never_written_anywhere(
    platform: Any, worker: Any, tag: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A canary token through success, retry and dead-letter paths: in no log line, record,
    event, dead letter or job row."""
    canary = f"canary-token-{tag}"
    caplog.set_level("DEBUG")
    with (
        GraphPeer(token=canary) as graph,
        publisher_settings(platform, graph, retry_backoff={"base": 0.1, "max": 0.2}),
    ):
        graph.fail_next(1, status=500, path_contains=f"ok-{tag}")
        ok = schedule_post(platform, plan(tag, account=f"ok-{tag}"))
        graph.fail_next(1, status=400, code=190, path_contains=f"bad-{tag}")
        bad = schedule_post(platform, plan(tag, account=f"bad-{tag}"))
        assert platform.job(ok.job_id).wait(30) == s.SUCCEEDED
        assert platform.job(bad.job_id).wait(30) == s.DEAD
    with platform.engine.connect() as conn:
        rows = [
            *conn.execute(select(t.posts).where(t.posts.c.id.in_([ok.id, bad.id]))).mappings(),
            *conn.execute(select(s.jobs).where(s.jobs.c.id.in_([ok.job_id, bad.job_id]))).mappings(),
            *conn.execute(
                select(s.job_events).where(s.job_events.c.job_id.in_([ok.job_id, bad.job_id]))
            ).mappings(),
            *conn.execute(select(s.dead_letters).where(s.dead_letters.c.job_id == bad.job_id)).mappings(),
        ]
    assert rows and all(canary not in repr(dict(r)) for r in rows)
    assert canary not in caplog.text
