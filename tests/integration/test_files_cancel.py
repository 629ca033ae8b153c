"""A file cancelled while a stage works on it: the stage's compare-and-set is refused, its
job ends ``skipped`` and it writes nothing (no text, no chunk rows, no vectors), and
nothing of the file is searchable."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.store.db import schema as s
from conveyor.store.db.schema import job_events, jobs
from pipelines.files import Upload, batch_status, cancel_batch, process_batch, search
from tasks.files.models import chunks, files
from tests.helpers import eventually
from tests.integration.files_support import completed, embedded_chunks, file_row

pytestmark = pytest.mark.timeout(300)

WORDS = [
    "beekeeper",
    "lighthouse",
    "sourdough",
    "volcano",
    "grandmaster",
    "orchid",
    "basalt",
    "Fresnel",
    "caldera",
]


def _long_text(megabytes: float) -> bytes:
    rng = random.Random(7)
    out: list[str] = []
    size = 0
    while size < megabytes * 1024 * 1024:
        sentence = " ".join(rng.choice(WORDS) for _ in range(12)) + ".\n"
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()


def _job(platform: Any, stage: str, file_id: str) -> Any:
    with platform.engine.connect() as conn:
        rows = conn.execute(select(jobs).where(jobs.c.stage == f"conveyor.files.{stage}")).mappings().all()
    found = [r for r in rows if (r["payload"] or {}).get("file_id") == file_id]
    return found[0] if found else None


def _cancelled_from(platform: Any, file_id: str) -> str | None:
    """The state the file was cancelled in (from its ``file.status_changed`` events)."""
    with platform.engine.connect() as conn:
        bodies = conn.execute(
            select(job_events.c.body)
            .where(job_events.c.topic == "file.status_changed")
            .order_by(job_events.c.id)
        ).scalars()
        found = [b["from"] for b in bodies if b.get("file_id") == file_id and b.get("to") == "cancelled"]
    return found[-1] if found else None


def _cancel_mid_stage(platform: Any, owner: str, stage: str, state: str) -> tuple[str, str] | None:
    """Cancel a long document's batch while ``stage`` runs it; None when the stage finished
    between being seen running and the cancel (then the next stage met the cancel)."""
    batch_id = process_batch(platform, owner, [Upload(f"{owner}-long.txt", _long_text(3))])
    file_id = next(f["id"] for f in batch_status(platform, batch_id)["files"])
    eventually(
        lambda: (
            file_row(platform, file_id)["status"] == state
            and (j := _job(platform, stage, file_id)) is not None
            and j["status"] == s.RUNNING
        ),
        timeout=60,
        interval=0.01,
    )
    assert cancel_batch(platform, batch_id) == 1
    return (batch_id, file_id) if _cancelled_from(platform, file_id) == state else None


@pytest.mark.parametrize(
    ("stage", "state"), [("extract", "extracting"), ("chunk", "chunking"), ("embed", "embedding")]
)
def test_a_file_cancelled_mid_stage_ends_the_job_skipped_and_writes_nothing(
    platform: Any, worker: Any, tag: str, stage: str, state: str
) -> None:
    for attempt in range(5):
        owner = f"{tag}-{attempt}"
        landed = _cancel_mid_stage(platform, owner, stage, state)
        if landed is not None:
            break
    else:
        pytest.fail(f"the cancel never landed while {stage} ran")
    batch_id, file_id = landed
    job = eventually(
        lambda: (j := _job(platform, stage, file_id)) is not None and j["status"] in s.TERMINAL and j,
        timeout=60,
    )
    assert job["status"] == s.SKIPPED, (job["status"], job["last_error"])
    with platform.engine.connect() as conn:
        reasons = (
            conn.execute(
                select(job_events.c.body).where(
                    job_events.c.job_id == job["id"], job_events.c.topic == "job.skipped"
                )
            )
            .scalars()
            .all()
        )
    assert [r["reason"] for r in reasons] == ["file found cancelled"]
    row = file_row(platform, file_id)
    assert row["status"] == "cancelled"
    with platform.engine.connect() as conn:
        stored = conn.execute(select(func.count()).where(chunks.c.file_id == file_id)).scalar_one()
    # no chunk row, no vector: nothing of it is searchable
    assert (stored, embedded_chunks(platform, [file_id])) == (0, 0)
    if stage == "extract":
        assert row["text"] is None
    elif stage == "chunk":
        assert row["chunk_count"] is None
    hits = search(platform, "lighthouse beekeeper caldera", owner=owner)
    assert [h for h in hits if h.file_id == file_id] == []
    batch = completed(platform, batch_id, timeout=30)
    assert (batch["cancelled"], batch["ready"]) == (1, 0)
    with platform.engine.connect() as conn:
        assert conn.execute(select(files.c.status).where(files.c.id == file_id)).scalar_one() == "cancelled"


def test_a_file_cancelled_while_its_chunks_are_staged_leaves_none_on_sqlite(
    on_sqlite: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite the chunk stage stages a big document's chunks in short transactions
    before its outcome: a cancel meanwhile leaves no chunk row at all (the file's or
    staged), whichever way the job ends."""
    from tasks.files import flow

    monkeypatch.setattr(flow, "STAGE_BYTES", 2048)  # ~1500 staging transactions: the cancel lands among them
    for attempt in range(5):
        owner = f"{tag}-{attempt}"
        landed = _cancel_mid_stage(on_sqlite, owner, "chunk", "chunking")
        if landed is not None:
            break
    else:
        pytest.fail("the cancel never landed while chunk ran")
    batch_id, file_id = landed
    job = eventually(
        lambda: (j := _job(on_sqlite, "chunk", file_id)) is not None and j["status"] in s.TERMINAL and j,
        timeout=60,
    )
    assert job["status"] in (s.SKIPPED, s.CANCELLED), (job["status"], job["last_error"])
    with on_sqlite.engine.connect() as conn:
        left = conn.execute(select(func.count()).where(chunks.c.owner == owner)).scalar_one()
    assert left == 0
    assert search(on_sqlite, "lighthouse beekeeper caldera", owner=owner) == []
    batch = completed(on_sqlite, batch_id, timeout=30)
    assert (batch["cancelled"], batch["ready"]) == (1, 0)
