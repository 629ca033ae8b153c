"""The files pipeline under a worker SIGKILL: the file still reaches ``ready``, and a
killed last attempt still reports the stall.

The kill point is deterministic: the stored content is replaced by a named pipe, so the
extract stage blocks reading it (a storage read that hangs) until the test has killed
the worker and put the real content back.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.store.db.schema import job_events
from pipelines.files import Upload, confirm, upload
from tasks.files.models import files
from tasks.files.stages import _settings, extract_stage
from tasks.files.storage import LocalStorage
from tests.fault.conftest import Spawn, kill_group
from tests.helpers import eventually

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]

TEXT = b"The lighthouse keeper trimmed the wick and polished the Fresnel lens before the fog rolled in."


def _file(platform: Any, file_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(files).where(files.c.id == file_id)).mappings().one()


def _blocking_upload(platform: Any, owner: str) -> tuple[str, Path]:
    """An uploaded file whose stored content is a named pipe: extract blocks reading it."""
    file_id = upload(platform, owner, Upload("keeper.txt", TEXT))
    path: Path = LocalStorage(_settings().files_storage_dir())._path(_file(platform, file_id)["content_ref"])
    path.unlink()
    os.mkfifo(path)
    return file_id, path


def _stalled(platform: Any, file_id: str) -> list[dict[str, Any]]:
    with platform.engine.connect() as conn:
        return [
            dict(b)
            for b in conn.execute(
                select(job_events.c.body).where(job_events.c.topic == "file.processing_stalled")
            ).scalars()
            if b.get("file_id") == file_id
        ]


def test_sigkill_during_extraction_still_reaches_ready(platform: Any, spawn: Spawn, tag: str) -> None:
    file_id, path = _blocking_upload(platform, tag)

    first = spawn()
    assert confirm(platform, file_id)
    eventually(lambda: _file(platform, file_id)["status"] == "extracting", timeout=60)
    kill_group(first)

    staged = path.with_name(path.name + ".new")
    staged.write_bytes(TEXT)
    os.replace(staged, path)
    spawn()
    row = eventually(lambda: (f := _file(platform, file_id))["status"] == "ready" and f, timeout=120)
    assert row["chunk_count"] >= 1
    stalled = _stalled(platform, file_id)
    assert stalled and stalled[0]["stage"] == "extract" and stalled[0]["retry_count"] == 1


def test_the_last_attempt_dying_still_reports_the_stall(
    platform: Any, spawn: Spawn, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extract_stage, "spec", dataclasses.replace(extract_stage.spec, max_attempts=1))
    file_id, _ = _blocking_upload(platform, tag)

    first = spawn()
    assert confirm(platform, file_id)
    eventually(lambda: _file(platform, file_id)["status"] == "extracting", timeout=60)
    kill_group(first)
    spawn()  # its relay finds the stalled last attempt and buries it
    row = eventually(lambda: (f := _file(platform, file_id))["status"] == "failed" and f, timeout=120)
    assert row["error_type"] == "WorkerLost" and row["failed_stage"] == "extract"
    stalled = _stalled(platform, file_id)
    assert len(stalled) == 1
    assert (stalled[0]["stage"], stalled[0]["retry_count"], stalled[0]["owner"]) == ("extract", 1, tag)
