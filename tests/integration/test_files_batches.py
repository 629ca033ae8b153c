"""The seed's primary flow: new batch → upload (N files) → confirm each → sealed (by its expected
count or explicitly) → completed exactly once, whichever comes last, on a real worker.
Uploads that fail leave nothing behind; batches answer only to their owner."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.store.db.schema import dead_letters, job_events, jobs
from pipelines.files import (
    BatchClosed,
    Upload,
    batch_status,
    cancel_batch,
    confirm,
    new_batch,
    process_batch,
    retry_failed,
    seal_batch,
    upload,
)
from tasks.files.errors import FileTooLarge
from tasks.files.models import files
from tasks.files.stages import _settings
from tests.helpers import eventually
from tests.integration.files_support import (
    TOPICS,
    batch_events,
    batch_row,
    completed,
    completed_events,
    file_row,
)

pytestmark = pytest.mark.timeout(300)


def _doc(topic: str) -> Upload:
    return Upload(f"{topic}.txt", TOPICS[topic].encode())


def _all_ready(platform: Any, ids: list[str]) -> bool:
    return all(file_row(platform, f)["status"] == "ready" for f in ids)


def test_seed_flow_upload_confirm_then_seal_completes_once(platform: Any, worker: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag)
    ids = [upload(platform, tag, _doc(t), batch_id=batch_id) for t in ("chess", "orchids")]
    assert all(confirm(platform, f) for f in ids)
    eventually(lambda: _all_ready(platform, ids), timeout=60)
    assert batch_row(platform, batch_id)["status"] == "open"  # not sealed: more files may come
    sealed = seal_batch(platform, batch_id)  # the seal comes last: it completes the batch
    assert sealed["status"] == "completed" and sealed["total"] == sealed["ready"] == 2
    assert seal_batch(platform, batch_id)["status"] == "completed"  # idempotent
    assert completed_events(platform, batch_id) == 1
    body = batch_events(platform, "batch.completed", batch_id)[0]
    assert (body["total"], body["ready"], body["failed"], body["owner"]) == (2, 2, 0, tag)


def test_sealed_first_the_last_file_completes_it(platform: Any, worker: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag)
    ids = [upload(platform, tag, _doc(t), batch_id=batch_id) for t in ("chess", "volcanoes")]
    assert seal_batch(platform, batch_id)["status"] == "processing"
    with pytest.raises(BatchClosed):
        upload(platform, tag, _doc("orchids"), batch_id=batch_id)
    for f in ids:
        confirm(platform, f)
    batch = completed(platform, batch_id, timeout=60)
    assert (batch["total"], batch["ready"]) == (2, 2)
    assert completed_events(platform, batch_id) == 1


def test_expected_count_seals_at_the_last_upload(platform: Any, worker: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag, expected=2)
    first = upload(platform, tag, _doc("chess"), batch_id=batch_id)
    assert confirm(platform, first)
    eventually(lambda: file_row(platform, first)["status"] == "ready", timeout=60)
    assert batch_row(platform, batch_id)["status"] == "open"  # one of two: not complete
    second = upload(platform, tag, _doc("sourdough"), batch_id=batch_id)
    assert batch_row(platform, batch_id)["sealed"] is True
    with pytest.raises(BatchClosed):
        upload(platform, tag, _doc("orchids"), batch_id=batch_id)
    assert confirm(platform, second)
    batch = completed(platform, batch_id, timeout=60)
    assert (batch["expected"], batch["total"], batch["ready"]) == (2, 2, 2)
    assert completed_events(platform, batch_id) == 1


def test_sealing_short_of_the_expected_count_completes_with_what_came(
    platform: Any, worker: Any, tag: str
) -> None:
    batch_id = new_batch(platform, tag, expected=5)
    only = upload(platform, tag, _doc("chess"), batch_id=batch_id)
    confirm(platform, only)
    eventually(lambda: file_row(platform, only)["status"] == "ready", timeout=60)
    assert seal_batch(platform, batch_id)["status"] == "completed"
    assert completed_events(platform, batch_id) == 1


def test_an_empty_expected_batch_completes_at_once(platform: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag, expected=0)
    assert batch_row(platform, batch_id)["status"] == "completed"
    assert completed_events(platform, batch_id) == 1


def test_progress_counts_every_state_and_every_event_names_the_owner(
    platform: Any, worker: Any, tag: str
) -> None:
    batch_id = process_batch(platform, tag, [_doc("chess"), _doc("orchids"), _doc("lighthouses")])
    completed(platform, batch_id, timeout=60)
    progress = batch_events(platform, "batch.progress", batch_id)
    assert progress, "no batch.progress event"
    states = ("queued", "extracting", "chunking", "embedding", "ready", "failed", "cancelled")
    for body in progress:
        assert set(states) <= set(body) and body["owner"] == tag and body["total"] == 3
    assert progress[-1]["ready"] == 3 and progress[-1]["queued"] == 0
    assert all(sum(body[state] for state in states) == 3 for body in progress)  # a consistent snapshot
    file_ids = {r["id"] for r in batch_status(platform, batch_id)["files"]}
    with platform.engine.connect() as conn:
        bodies = [
            dict(b)
            for b in conn.execute(
                select(job_events.c.body).where(
                    job_events.c.topic.like("file.%") | job_events.c.topic.like("batch.%")
                )
            ).scalars()
            if b.get("batch_id") == batch_id or b.get("file_id") in file_ids
        ]
    assert bodies and all(b.get("owner") == tag for b in bodies)


def test_a_confirmed_file_is_labelled_by_its_name_in_the_dlq(platform: Any, worker: Any, tag: str) -> None:
    name = f"{tag}-broken.pdf"
    file_id = upload(platform, tag, Upload(name, b"%PDF-1.7 truncated"))
    assert confirm(platform, file_id)
    eventually(lambda: file_row(platform, file_id)["status"] == "failed", timeout=60)
    with platform.engine.connect() as conn:
        labels = (
            conn.execute(
                select(dead_letters.c.label)
                .join(jobs, jobs.c.id == dead_letters.c.job_id)
                .where(jobs.c.payload["file_id"].as_string() == file_id)
            )
            .scalars()
            .all()
        )
    assert labels == [name]


def test_batches_answer_only_to_their_owner(platform: Any, worker: Any, tag: str) -> None:
    mine = process_batch(platform, f"{tag}-a", [Upload("bad.pdf", b"%PDF-1.4 not really")])
    theirs = process_batch(platform, f"{tag}-b", [Upload("bad.pdf", b"%PDF-1.4 not really")])
    completed(platform, mine, timeout=60)
    completed(platform, theirs, timeout=60)
    other = f"{tag}-b"
    with pytest.raises(LookupError):
        batch_status(platform, mine, owner=other)
    with pytest.raises(LookupError):
        cancel_batch(platform, mine, owner=other)
    with pytest.raises(LookupError):
        retry_failed(platform, mine, owner=other)
    with pytest.raises(LookupError):
        seal_batch(platform, mine, owner=other)
    # The owner's retry touches only its own batch's dead letters, never the other user's.
    retried = retry_failed(platform, mine, owner=f"{tag}-a")
    assert len(retried) == 1
    their_files = [r["id"] for r in batch_status(platform, theirs)["files"]]
    with platform.engine.connect() as conn:
        untouched = conn.execute(
            select(func.count())
            .select_from(dead_letters)
            .join(jobs, jobs.c.id == dead_letters.c.job_id)
            .where(
                jobs.c.payload["file_id"].as_string().in_(their_files),
                dead_letters.c.retried_at.is_(None),
            )
        ).scalar_one()
    assert untouched == 1


def test_cancelling_an_open_batch_seals_it_and_completes_it(platform: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag)
    upload(platform, tag, _doc("chess"), batch_id=batch_id)
    upload(platform, tag, _doc("orchids"), batch_id=batch_id)
    assert cancel_batch(platform, batch_id) == 2
    batch = batch_row(platform, batch_id)
    assert (batch["status"], batch["cancelled"], batch["total"]) == ("completed", 2, 2)
    assert completed_events(platform, batch_id) == 1


# -- uploads: streamed, bounded, never an orphan -----------------------------------------------------


def _objects(platform: Any) -> set[Path]:
    root = _settings().files_storage_dir()
    return {p for p in root.rglob("*") if p.is_file()}


class _Endless(io.RawIOBase):
    """A stream that never ends (and counts what was read from it)."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = len(buffer)
        buffer[:n] = b"a" * n
        self.read_bytes += n
        return n


def test_an_oversized_stream_is_refused_without_buffering_and_leaves_nothing(platform: Any, tag: str) -> None:
    before = _objects(platform)
    source = _Endless()
    max_bytes = _settings().files.max_bytes
    with pytest.raises(FileTooLarge, match="over the"):
        upload(platform, tag, Upload("endless.txt", stream=source))  # type: ignore[arg-type]
    assert source.read_bytes <= max_bytes + 2 * 1024 * 1024  # stopped just past the limit
    assert _objects(platform) == before
    with platform.engine.connect() as conn:
        assert conn.execute(select(func.count()).where(files.c.owner == tag)).scalar_one() == 0


def test_a_known_oversized_path_is_refused_before_reading(platform: Any, tag: str, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with big.open("wb") as handle:
        handle.truncate(_settings().files.max_bytes + 1)  # sparse: nothing to read anyway
    with pytest.raises(FileTooLarge, match="over the"):
        upload(platform, tag, Upload.from_path(big))


def test_a_failed_insert_leaves_no_object(platform: Any, tag: str) -> None:
    before = _objects(platform)
    with pytest.raises(Exception):  # noqa: B017 - the database refuses the 300-character owner
        upload(platform, tag + "x" * 300, _doc("chess"))
    assert _objects(platform) == before


def test_an_upload_to_a_sealed_batch_is_refused_and_leaves_nothing(platform: Any, tag: str) -> None:
    batch_id = new_batch(platform, tag)
    seal_batch(platform, batch_id)
    before = _objects(platform)
    with pytest.raises(BatchClosed):
        upload(platform, tag, _doc("chess"), batch_id=batch_id)
    assert _objects(platform) == before
    with pytest.raises(LookupError):
        upload(platform, f"{tag}-other", _doc("chess"), batch_id=batch_id)


def test_a_batch_with_an_oversized_file_records_it_failed_and_goes_on(
    platform: Any, worker: Any, tag: str, tmp_path: Path
) -> None:
    big = tmp_path / "huge.txt"
    with big.open("wb") as handle:
        handle.truncate(_settings().files.max_bytes + 1)
    batch_id = process_batch(platform, tag, [_doc("chess"), Upload.from_path(big)])
    batch = completed(platform, batch_id, timeout=60)
    assert (batch["total"], batch["ready"], batch["failed"]) == (2, 1, 1)
    refused = next(f for f in batch_status(platform, batch_id)["files"] if f["name"] == "huge.txt")
    assert refused["status"] == "failed" and "over the" in refused["error"]


def test_each_stage_has_its_queue_and_the_seeds_rate_limits_apply(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from config.queues import SEED_FILE_RATE_LIMITS
    from conveyor.worker.admission import RateLimit

    for queue, limit in SEED_FILE_RATE_LIMITS.items():
        monkeypatch.setitem(platform.settings.rate_limits, queue, RateLimit(rate=limit["rate"], burst=1))
        platform.redis.delete(f"{platform.settings.key_prefix}rate:{queue}")
    batch_id = process_batch(platform, tag, [_doc(t) for t in ("chess", "orchids", "volcanoes")])
    completed(platform, batch_id, timeout=120)
    file_ids = [f["id"] for f in batch_status(platform, batch_id)["files"]]
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(jobs.c.id, jobs.c.stage, jobs.c.queue).where(
                jobs.c.payload["file_id"].as_string().in_(file_ids)
            )
        ).all()
        limited = (
            conn.execute(
                select(job_events.c.body).where(
                    job_events.c.topic == "job.rate_limited", job_events.c.job_id.in_([r.id for r in rows])
                )
            )
            .scalars()
            .all()
        )
    assert {(r.stage, r.queue) for r in rows} == {
        ("conveyor.files.extract", "file-extract"),
        ("conveyor.files.chunk", "file-chunk"),
        ("conveyor.files.embed", "file-embed"),
    }
    # Embed runs at chunk's pace already (the same rate), so it may never need parking.
    assert {"file-extract", "file-chunk"} <= {b["queue"] for b in limited}


def test_a_batch_whose_results_outgrow_a_payload_still_runs_its_chord_body(
    platform: Any, worker: Any, tag: str
) -> None:
    """120 files with 480-character names: their chain results together are over the 64 KiB
    payload limit, which the chord body must not carry."""
    items = [Upload(f"{i:03d}-" + "n" * 476 + ".txt", f"note {i} on beekeeping".encode()) for i in range(120)]
    batch_id = process_batch(platform, tag, items)
    completed(platform, batch_id, timeout=240)

    def body() -> Any:
        with platform.engine.connect() as conn:
            return conn.execute(
                select(jobs.c.status, jobs.c.payload).where(
                    jobs.c.stage == "conveyor.files.complete_batch", jobs.c.label == batch_id
                )
            ).one_or_none()

    row = eventually(lambda: (r := body()) is not None and r.status == "succeeded" and r, timeout=60)
    assert "results" not in row.payload


class _Broken(io.RawIOBase):
    """A source that fails half way (a dropped client connection)."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise OSError("connection reset by peer")


def test_a_submit_failing_half_way_closes_its_batch_instead_of_leaving_it_open(
    platform: Any, tag: str
) -> None:
    from tasks.files.errors import UploadInterrupted
    from tasks.files.models import batches

    with pytest.raises(UploadInterrupted, match="connection reset"):
        process_batch(platform, tag, [_doc("chess"), Upload("dropped.txt", stream=_Broken())])  # type: ignore[arg-type]
    with platform.engine.connect() as conn:
        batch = conn.execute(select(batches).where(batches.c.owner == tag)).mappings().one()
        left = conn.execute(select(files.c.status).where(files.c.owner == tag)).scalars().all()
    assert (batch["status"], batch["total"], batch["cancelled"]) == ("completed", 1, 1)
    assert left == ["cancelled"]  # the dropped upload left no row (and no object)


def test_a_cli_retry_in_a_fresh_process_revives_the_fixed_files(platform: Any, worker: Any, tag: str) -> None:
    """``conveyor files retry`` runs in a process that never imported the stages: the DLQ
    retry must still run their ``on_retry`` hook (failed → queued) and their budget."""
    import subprocess
    import sys

    from conveyor.delivery.procs import service_env
    from pipelines.files import replace_content

    batch_id = process_batch(platform, tag, [Upload("empty.txt", b""), _doc("chess")])
    completed(platform, batch_id, timeout=60)
    empty = next(f["id"] for f in batch_status(platform, batch_id)["files"] if f["name"] == "empty.txt")
    assert file_row(platform, empty)["error_type"] == "EmptyDocument"
    replace_content(platform, empty, b"Barn owls hunt at night over the meadow.")
    cli = subprocess.run(
        [sys.executable, "-m", "conveyor", "files", "retry", batch_id, "--user", tag],
        env=service_env(platform.settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "retried 1 file" in cli.stdout, cli.stdout + cli.stderr
    row = eventually(lambda: (r := file_row(platform, empty))["status"] == "ready" and r, timeout=60)
    assert "owls" in row["text"]
    with platform.engine.connect() as conn:
        budget = conn.execute(
            select(jobs.c.max_attempts).where(
                jobs.c.stage == "conveyor.files.extract", jobs.c.payload["file_id"].as_string() == empty
            )
        ).scalar_one()
    assert budget == 1 + 4  # the attempt used, plus the stage's own budget (not the default 3)


def test_file_names_that_are_not_valid_text_are_cleaned(platform: Any, tag: str) -> None:
    """A Latin-1 name read from a UTF-8 file system (lone surrogates) or a NUL in a name
    crashed the upload (UnicodeEncodeError; the driver's DataError with its SQL)."""
    odd = upload(platform, tag, Upload("caf\udce9.txt", b"x"))
    nul = upload(platform, tag, Upload("a\x00b\x1b.txt", b"x"))
    assert file_row(platform, odd)["name"] == "caf\ufffd.txt"
    assert file_row(platform, nul)["name"] == "ab.txt"


def test_an_unconfirmed_upload_of_a_sealed_batch_is_cancelled_so_the_batch_completes(
    platform: Any, worker: Any, tag: str
) -> None:
    from tasks.files.stages import cancel_unconfirmed

    batch_id = new_batch(platform, tag, expected=2)
    first = upload(platform, tag, _doc("chess"), batch_id=batch_id)
    forgotten = upload(platform, tag, _doc("orchids"), batch_id=batch_id)  # its confirm never came
    confirm(platform, first)
    eventually(lambda: file_row(platform, first)["status"] == "ready", timeout=60)
    assert batch_row(platform, batch_id)["status"] == "processing"
    assert cancel_unconfirmed(older_than=0) >= 1
    row = file_row(platform, forgotten)
    assert row["status"] == "cancelled" and "never confirmed" in row["error"]
    batch = completed(platform, batch_id, timeout=10)
    assert (batch["ready"], batch["cancelled"]) == (1, 1)


def test_search_compares_only_vectors_of_its_model_and_reembed_fixes_a_change(
    platform: Any, worker: Any, tag: str
) -> None:
    """Vectors of another model (an embedder changed in the settings) were compared with the
    query's anyway: garbage scores, or a crash for another dimension."""
    import subprocess
    import sys

    from conveyor.delivery.procs import service_env
    from pipelines.files import search
    from tasks.files.errors import EmbeddingModelMismatch
    from tasks.files.models import file_vectors

    batch_id = process_batch(platform, tag, [_doc("lighthouses"), _doc("orchids")])
    completed(platform, batch_id, timeout=60)
    assert search(platform, "Fresnel lens keeper", owner=tag)[0].name == "lighthouses.txt"
    ids = [f["id"] for f in batch_status(platform, batch_id)["files"]]
    with platform.engine.begin() as conn:  # as if written by another model, 768-d
        conn.execute(
            file_vectors.update()
            .where(file_vectors.c.file_id == ids[0])
            .values(model="other-768d", vectors=b"\0" * 3072)
        )
    with pytest.raises(EmbeddingModelMismatch, match=r"other-768d.*wordllama-256"):
        search(platform, "Fresnel lens keeper", owner=tag)
    cli = subprocess.run(
        [sys.executable, "-m", "conveyor", "files", "reembed", "--user", tag],
        env=service_env(platform.settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "re-embedded" in cli.stdout, cli.stdout + cli.stderr
    assert search(platform, "Fresnel lens keeper", owner=tag)[0].name == "lighthouses.txt"
