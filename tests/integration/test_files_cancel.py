"""A file cancelled while a stage works on it: the stage's compare-and-set is refused, its
job ends ``skipped`` and it writes nothing (no text, no chunk rows, no vectors)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.db import schema as s
from conveyor.db.schema import job_events, jobs
from pipelines.files import Upload, batch_status, cancel_batch, process_batch
from tasks.files.models import chunks, files
from tests.helpers import eventually
from tests.integration.files_support import completed, file_row

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


@pytest.mark.parametrize(
    ("stage", "state"), [("extract", "extracting"), ("chunk", "chunking"), ("embed", "embedding")]
)
def test_a_file_cancelled_mid_stage_ends_the_job_skipped_and_writes_nothing(
    platform: Any, worker: Any, tag: str, stage: str, state: str
) -> None:
    batch_id = process_batch(platform, tag, [Upload(f"{tag}-long.txt", _long_text(3))])
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
        stored = conn.execute(
            select(func.count(), func.count(chunks.c.embedding)).where(chunks.c.file_id == file_id)
        ).one()
    if stage == "extract":
        assert row["text"] is None and stored == (0, 0)
    elif stage == "chunk":
        assert row["chunk_count"] is None and stored == (0, 0)
    else:
        assert stored[0] > 0 and stored[1] == 0  # the chunks stay; no vector was written
    batch = completed(platform, batch_id, timeout=30)
    assert (batch["cancelled"], batch["ready"]) == (1, 0)
    with platform.engine.connect() as conn:
        assert conn.execute(select(files.c.status).where(files.c.id == file_id)).scalar_one() == "cancelled"
