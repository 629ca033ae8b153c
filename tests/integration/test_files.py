"""The files pipeline end to end on a real worker: chords, Postgres-owned completion,
permanent failures that never block a batch, search scoped to a user."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters, jobs
from pipelines.files import Upload, confirm, process_batch, search, upload
from tasks.files.models import files
from tests.helpers import discarded, eventually
from tests.integration.files_support import (
    FIXTURES,
    TOPICS,
    batch_events,
    batch_row,
    completed,
    completed_events,
    docs,
    file_row,
)

pytestmark = pytest.mark.timeout(300)


def test_25_file_batch_completes_exactly_once(platform: Any, worker: Any, tag: str) -> None:
    batch_id = process_batch(platform, tag, docs(25, tag))
    batch = completed(platform, batch_id, timeout=240)
    assert batch["total"] == batch["terminal"] == batch["ready"] == 25 and batch["failed"] == 0
    with platform.engine.connect() as conn:
        states = conn.execute(
            select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
        ).all()
    assert dict(states) == {"ready": 25}
    # The chord body, run again (a duplicate firing), cannot complete the batch twice.
    from tasks.files.stages import complete_batch

    complete_batch.delay(batch_id=batch_id, results=[]).job.wait(30)
    assert completed_events(platform, batch_id) == 1


def test_corrupt_pdf_fails_once_and_never_blocks_its_batch(platform: Any, worker: Any, tag: str) -> None:
    good = (FIXTURES / "alpine-glaciers.pdf").read_bytes()
    corrupt = good[: len(good) // 3]
    batch_id = process_batch(platform, tag, [Upload("glaciers.pdf", good), Upload("broken.pdf", corrupt)])
    batch = completed(platform, batch_id, timeout=120)
    assert (batch["ready"], batch["failed"]) == (1, 1)
    with platform.engine.connect() as conn:
        broken = (
            conn.execute(select(files).where(files.c.batch_id == batch_id, files.c.name == "broken.pdf"))
            .mappings()
            .one()
        )
        letter = (
            conn.execute(
                select(dead_letters).where(
                    dead_letters.c.stage == "conveyor.files.extract", dead_letters.c.label == "broken.pdf"
                )
            )
            .mappings()
            .one()
        )
        job = conn.execute(select(jobs).where(jobs.c.id == letter["job_id"])).mappings().one()
    assert broken["status"] == "failed" and broken["failed_stage"] == "extract"
    assert letter["error_type"] == "CorruptFile" and "corrupt" in letter["message"].lower()
    assert job["attempts"] == 1 and job["status"] == s.DEAD
    assert completed_events(platform, batch_id) == 1


def test_confirming_the_same_file_twice_launches_one_flow(platform: Any, worker: Any, tag: str) -> None:
    file_id = upload(platform, tag, Upload("note.txt", TOPICS["chess"].encode()))
    assert confirm(platform, file_id) is True
    assert confirm(platform, file_id) is False
    eventually(lambda: file_row(platform, file_id)["status"] == "ready", timeout=60)
    with platform.engine.connect() as conn:
        payloads = conn.execute(
            select(jobs.c.payload).where(jobs.c.stage == "conveyor.files.extract")
        ).scalars()
        n = sum(1 for p in payloads if p.get("file_id") == file_id)
    assert n == 1


def test_search_ranks_each_document_first_and_stays_within_the_user(
    platform: Any, worker: Any, tag: str
) -> None:
    mine = [Upload(f"{name}.txt", text.encode()) for name, text in TOPICS.items()]
    mine.append(Upload("alpine-glaciers.pdf", (FIXTURES / "alpine-glaciers.pdf").read_bytes()))
    batch_id = process_batch(platform, tag, mine)
    other = process_batch(platform, tag + "-other", [Upload("spy-orchids.txt", TOPICS["orchids"].encode())])
    for b in (batch_id, other):
        eventually(lambda b=b: batch_row(platform, b)["status"] == "completed", timeout=120)
    queries = {
        "beekeeping.txt": "queen brood frames varroa honey",
        "lighthouses.txt": "keeper Fresnel lens foghorn headland",
        "sourdough.txt": "starter rye yeast dough oven",
        "volcanoes.txt": "lava fissure caldera sulfur",
        "chess.txt": "grandmaster knight endgame pawns rook",
        "orchids.txt": "orchids velamen aerial roots bees",
    }
    for name, query in queries.items():
        hits = search(platform, query, owner=tag)
        assert hits and hits[0].name == name, (query, [(h.name, round(h.score, 3)) for h in hits])
        assert all(h.name != "spy-orchids.txt" for h in hits)


def test_duplicate_header_task_and_lost_chord_counter_still_complete_once(
    platform: Any, worker: Any, tag: str
) -> None:
    from tests.helpers import publish_again

    batch_id = process_batch(platform, tag, docs(4, tag))
    with platform.engine.connect() as conn:
        extract_jobs = [
            r
            for r in conn.execute(select(jobs).where(jobs.c.stage == "conveyor.files.extract")).mappings()
            if r["label"].startswith(tag)
        ]
    # The chord's counter in the result backend is lost...
    for key in platform.redis.scan_iter("celery-taskset-meta-*"):
        platform.redis.delete(key)
    # ...and a header task is delivered twice.
    publish_again(platform, extract_jobs[0], task_id=extract_jobs[0]["origin_task_id"])
    batch = completed(platform, batch_id, timeout=120)
    assert (batch["ready"], batch["terminal"]) == (4, 4)
    time_to_settle = eventually(lambda: discarded(platform, extract_jobs[0]["id"]))
    assert time_to_settle
    assert completed_events(platform, batch_id) == 1


def _jobs_of(platform: Any, file_id: str) -> dict[str, list[Any]]:
    with platform.engine.connect() as conn:
        rows = conn.execute(select(jobs).where(jobs.c.stage.like("conveyor.files.%"))).mappings().all()
    out: dict[str, list[Any]] = {}
    for r in rows:
        if (r["payload"] or {}).get("file_id") == file_id:
            out.setdefault(r["stage"].rsplit(".", 1)[-1], []).append(r)
    return out


def test_fixed_file_retried_from_the_dlq_resumes_and_changes_the_summary(
    platform: Any, worker: Any, tag: str
) -> None:
    from pipelines.files import replace_content, retry_failed

    good = (FIXTURES / "alpine-glaciers.pdf").read_bytes()
    batch_id = process_batch(
        platform, tag, [Upload("fine.txt", TOPICS["chess"].encode()), Upload("broken.pdf", good[:4000])]
    )
    batch = completed(platform, batch_id, timeout=120)
    assert (batch["ready"], batch["failed"]) == (1, 1)
    with platform.engine.connect() as conn:
        broken = conn.execute(
            select(files.c.id).where(files.c.batch_id == batch_id, files.c.name == "broken.pdf")
        ).scalar_one()
    # Downstream stages ran with the failed marker and ended skipped (the batch may
    # complete first: it counts the file failed as soon as it is).
    before = eventually(
        lambda: (j := _jobs_of(platform, broken))
        and all(r["status"] == s.SKIPPED for r in j.get("chunk", []) + j.get("embed", []))
        and len(j.get("chunk", []) + j.get("embed", [])) == 2
        and j
    )
    assert [j["status"] for j in before["extract"]] == [s.DEAD]
    assert [j["status"] for j in before["chunk"] + before["embed"]] == [s.SKIPPED, s.SKIPPED]

    replace_content(platform, broken, good)
    assert retry_failed(platform, batch_id) == [before["extract"][0]["id"]]
    eventually(lambda: file_row(platform, broken)["status"] == "ready", timeout=120)
    after = _jobs_of(platform, broken)
    # The same three jobs ran again, in order: no new rows, nothing left behind.
    assert {k: [j["id"] for j in v] for k, v in after.items()} == {
        k: [j["id"] for j in v] for k, v in before.items()
    }
    assert all(j["status"] == s.SUCCEEDED for v in after.values() for j in v)
    assert after["extract"][0]["attempts"] == 2
    batch = batch_row(platform, batch_id)
    assert (batch["ready"], batch["failed"], batch["terminal"], batch["status"]) == (2, 0, 2, "completed")
    changes = batch_events(platform, "batch.summary_changed", batch_id)
    assert changes and (changes[-1]["ready"], changes[-1]["failed"]) == (2, 0)
    assert completed_events(platform, batch_id) == 1
    with platform.engine.connect() as conn:
        open_letters = conn.execute(
            select(func.count())
            .select_from(dead_letters)
            .where(dead_letters.c.job_id == before["extract"][0]["id"], dead_letters.c.retried_at.is_(None))
        ).scalar_one()
    assert open_letters == 0


def test_transient_embed_fault_exhausts_retries_then_a_dlq_retry_runs_embed_only(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipelines.files import retry_failed
    from tests.peers import embedding_peer

    with embedding_peer() as peer:
        monkeypatch.setattr(platform.settings.files, "embedder", peer.url)
        peer.failing = True
        batch_id = process_batch(platform, tag, [Upload("lighthouse.txt", TOPICS["lighthouses"].encode())])
        batch = eventually(
            lambda: (b := batch_row(platform, batch_id))["status"] == "completed" and b, timeout=120
        )
        assert (batch["ready"], batch["failed"]) == (0, 1)
        with platform.engine.connect() as conn:
            lighthouse = conn.execute(select(files).where(files.c.batch_id == batch_id)).mappings().one()
            letter = (
                conn.execute(
                    select(dead_letters).where(
                        dead_letters.c.stage == "conveyor.files.embed",
                        dead_letters.c.label == "lighthouse.txt",
                    )
                )
                .mappings()
                .one()
            )
        assert lighthouse["failed_stage"] == "embed" and lighthouse["error_type"] == "EmbeddingUnavailable"
        assert letter["attempts"] == 4 and "gave up after 4 of 4 attempts" in letter["message"]
        assert peer.refused == 4
        before = _jobs_of(platform, lighthouse["id"])

        peer.failing = False
        assert retry_failed(platform, batch_id) == [before["embed"][0]["id"]]
        eventually(lambda: file_row(platform, lighthouse["id"])["status"] == "ready", timeout=60)
    after = _jobs_of(platform, lighthouse["id"])
    # Extract and chunk did not run again: same rows, same attempts.
    for stage in ("extract", "chunk"):
        assert [(j["id"], j["attempts"]) for j in after[stage]] == [
            (j["id"], j["attempts"]) for j in before[stage]
        ]
    assert [(j["attempts"], j["status"]) for j in after["embed"]] == [(5, s.SUCCEEDED)]
    changes = batch_events(platform, "batch.summary_changed", batch_id)
    assert (changes[-1]["ready"], changes[-1]["failed"]) == (1, 0)
    assert completed_events(platform, batch_id) == 1
