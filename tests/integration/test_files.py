"""The files pipeline end to end on a real worker: chords, Postgres-owned completion,
permanent failures that never block a batch, search scoped to a user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.db import schema as s
from conveyor.db.schema import dead_letters, job_events, jobs
from pipelines.files import Upload, confirm, process_batch, search, upload
from tasks.files.models import batches, files
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "files"

TOPICS = {
    "beekeeping": "Beekeepers inspect the brood frames every week, checking the queen, the honey stores and "
    "signs of varroa mites before the summer nectar flow.",
    "lighthouses": "The lighthouse keeper trimmed the wick, polished the Fresnel lens and logged passing "
    "schooners while the foghorn sounded across the rocky headland.",
    "sourdough": "A sourdough starter of rye flour and water ferments for days; wild yeast and lactobacilli "
    "leaven the dough, which is folded, proofed overnight and baked in a Dutch oven.",
    "volcanoes": "Basaltic lava fountains erupted from the fissure; seismometers recorded tremor while "
    "volcanologists sampled sulfur dioxide near the caldera rim.",
    "chess": "The grandmaster sacrificed a knight on f7, opened the king's diagonal and converted the "
    "endgame with two connected passed pawns against a lone rook.",
    "orchids": "Epiphytic orchids cling to rainforest branches with aerial roots coated in velamen, "
    "absorbing mist while pollinating euglossine bees visit the fragrant blossoms.",
}


def _docs(n: int, tag: str) -> list[Upload]:
    names = list(TOPICS)
    return [
        Upload(
            f"{tag}-{i:03d}-{names[i % len(names)]}.txt",
            (TOPICS[names[i % len(names)]] + f" Note {i}.").encode(),
        )
        for i in range(n)
    ]


def _completed_events(platform: Any, batch_id: str) -> int:
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(job_events.c.body).where(job_events.c.topic == "batch.completed")
        ).scalars()
        return sum(1 for body in rows if body.get("batch_id") == batch_id)


def _batch(platform: Any, batch_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one()


def test_25_file_batch_completes_exactly_once(platform: Any, worker: Any, tag: str) -> None:
    batch_id = process_batch(platform, tag, _docs(25, tag))
    batch = eventually(lambda: (b := _batch(platform, batch_id))["status"] == "completed" and b, timeout=240)
    assert batch["total"] == batch["terminal"] == batch["ready"] == 25 and batch["failed"] == 0
    with platform.engine.connect() as conn:
        states = conn.execute(
            select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
        ).all()
    assert dict(states) == {"ready": 25}
    # The chord body, run again (a duplicate firing), cannot complete the batch twice.
    from tasks.files.stages import complete_batch

    complete_batch.delay(batch_id=batch_id, results=[]).job.wait(30)
    assert _completed_events(platform, batch_id) == 1


def test_corrupt_pdf_fails_once_and_never_blocks_its_batch(platform: Any, worker: Any, tag: str) -> None:
    good = (FIXTURES / "alpine-glaciers.pdf").read_bytes()
    corrupt = good[: len(good) // 3]
    batch_id = process_batch(platform, tag, [Upload("glaciers.pdf", good), Upload("broken.pdf", corrupt)])
    batch = eventually(lambda: (b := _batch(platform, batch_id))["status"] == "completed" and b, timeout=120)
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
    assert _completed_events(platform, batch_id) == 1


def test_confirming_the_same_file_twice_launches_one_flow(platform: Any, worker: Any, tag: str) -> None:
    file_id = upload(platform, tag, Upload("note.txt", TOPICS["chess"].encode()))
    assert confirm(platform, file_id) is True
    assert confirm(platform, file_id) is False
    eventually(lambda: _file(platform, file_id)["status"] == "ready", timeout=60)
    with platform.engine.connect() as conn:
        payloads = conn.execute(
            select(jobs.c.payload).where(jobs.c.stage == "conveyor.files.extract")
        ).scalars()
        n = sum(1 for p in payloads if p.get("file_id") == file_id)
    assert n == 1


def _file(platform: Any, file_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(files).where(files.c.id == file_id)).mappings().one()


def test_search_ranks_each_document_first_and_stays_within_the_user(
    platform: Any, worker: Any, tag: str
) -> None:
    mine = [Upload(f"{name}.txt", text.encode()) for name, text in TOPICS.items()]
    mine.append(Upload("alpine-glaciers.pdf", (FIXTURES / "alpine-glaciers.pdf").read_bytes()))
    batch_id = process_batch(platform, tag, mine)
    other = process_batch(platform, tag + "-other", [Upload("spy-orchids.txt", TOPICS["orchids"].encode())])
    for b in (batch_id, other):
        eventually(lambda b=b: _batch(platform, b)["status"] == "completed", timeout=120)
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

    batch_id = process_batch(platform, tag, _docs(4, tag))
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
    batch = eventually(lambda: (b := _batch(platform, batch_id))["status"] == "completed" and b, timeout=120)
    assert (batch["ready"], batch["terminal"]) == (4, 4)
    time_to_settle = eventually(
        lambda: "job.skipped" in [e.topic for e in platform.job(extract_jobs[0]["id"]).events()[0]]
    )
    assert time_to_settle
    assert _completed_events(platform, batch_id) == 1


def _events(platform: Any, topic: str, batch_id: str) -> list[dict[str, Any]]:
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(job_events.c.body).where(job_events.c.topic == topic).order_by(job_events.c.id)
        ).scalars()
        return [dict(body) for body in rows if body.get("batch_id") == batch_id]


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
    batch = eventually(lambda: (b := _batch(platform, batch_id))["status"] == "completed" and b, timeout=120)
    assert (batch["ready"], batch["failed"]) == (1, 1)
    with platform.engine.connect() as conn:
        broken = conn.execute(
            select(files.c.id).where(files.c.batch_id == batch_id, files.c.name == "broken.pdf")
        ).scalar_one()
    # Downstream stages ran with the failed marker and ended skipped.
    before = _jobs_of(platform, broken)
    assert [j["status"] for j in before["extract"]] == [s.DEAD]
    assert [j["status"] for j in before["chunk"] + before["embed"]] == [s.SKIPPED, s.SKIPPED]

    replace_content(platform, broken, good)
    assert retry_failed(platform, batch_id) == [before["extract"][0]["id"]]
    eventually(lambda: _file(platform, broken)["status"] == "ready", timeout=120)
    after = _jobs_of(platform, broken)
    # The same three jobs ran again, in order: no new rows, nothing left behind.
    assert {k: [j["id"] for j in v] for k, v in after.items()} == {
        k: [j["id"] for j in v] for k, v in before.items()
    }
    assert all(j["status"] == s.SUCCEEDED for v in after.values() for j in v)
    assert after["extract"][0]["attempts"] == 2
    batch = _batch(platform, batch_id)
    assert (batch["ready"], batch["failed"], batch["terminal"], batch["status"]) == (2, 0, 2, "completed")
    changes = _events(platform, "batch.summary_changed", batch_id)
    assert changes and (changes[-1]["ready"], changes[-1]["failed"]) == (2, 0)
    assert _completed_events(platform, batch_id) == 1
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
            lambda: (b := _batch(platform, batch_id))["status"] == "completed" and b, timeout=120
        )
        assert (batch["ready"], batch["failed"]) == (0, 1)
        with platform.engine.connect() as conn:
            file_row = conn.execute(select(files).where(files.c.batch_id == batch_id)).mappings().one()
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
        assert file_row["failed_stage"] == "embed" and file_row["error_type"] == "EmbeddingUnavailable"
        assert letter["attempts"] == 4 and "gave up after 4 of 4 attempts" in letter["message"]
        assert peer.refused == 4
        before = _jobs_of(platform, file_row["id"])

        peer.failing = False
        assert retry_failed(platform, batch_id) == [before["embed"][0]["id"]]
        eventually(lambda: _file(platform, file_row["id"])["status"] == "ready", timeout=60)
    after = _jobs_of(platform, file_row["id"])
    # Extract and chunk did not run again: same rows, same attempts.
    for stage in ("extract", "chunk"):
        assert [(j["id"], j["attempts"]) for j in after[stage]] == [
            (j["id"], j["attempts"]) for j in before[stage]
        ]
    assert [(j["attempts"], j["status"]) for j in after["embed"]] == [(5, s.SUCCEEDED)]
    changes = _events(platform, "batch.summary_changed", batch_id)
    assert (changes[-1]["ready"], changes[-1]["failed"]) == (1, 0)
    assert _completed_events(platform, batch_id) == 1
