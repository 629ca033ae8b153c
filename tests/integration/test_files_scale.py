"""The files pipeline at scale on a real worker: a 100-file batch, three users' batches
submitted at once, and content stored in S3 (moto's threaded server) end to end."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from sqlalchemy import func, select

from conveyor.store.db import schema as s
from conveyor.store.db.schema import jobs
from pipelines.files import Upload, confirm, process_batch, search, upload
from tasks.files.models import chunks, files
from tasks.files.storage import S3Settings
from tests.helpers import eventually
from tests.integration.files_support import (
    FIXTURES,
    TOPICS,
    batch_row,
    completed,
    completed_events,
    docs,
    embedded_chunks,
    file_row,
)

FILE_STAGES = ("conveyor.files.extract", "conveyor.files.chunk", "conveyor.files.embed")
COMPLETE_BATCH = "conveyor.files.complete_batch"

# Three users, each with vocabulary of their own: a query made of one user's words must never
# bring up another user's documents.
USERS: dict[str, dict[str, str]] = {
    "apiarist": {
        "beekeeping.txt": TOPICS["beekeeping"],
        "sourdough.txt": TOPICS["sourdough"],
    },
    "mariner": {
        "lighthouses.txt": TOPICS["lighthouses"],
        "volcanoes.txt": TOPICS["volcanoes"],
    },
    "botanist": {
        "chess.txt": TOPICS["chess"],
        "orchids.txt": TOPICS["orchids"],
    },
}
QUERIES: dict[str, dict[str, str]] = {
    "apiarist": {
        "beekeeping.txt": "queen brood frames varroa honey",
        "sourdough.txt": "starter rye yeast dough oven",
    },
    "mariner": {
        "lighthouses.txt": "keeper Fresnel lens foghorn headland",
        "volcanoes.txt": "lava fissure caldera sulfur",
    },
    "botanist": {
        "chess.txt": "grandmaster knight endgame pawns rook",
        "orchids.txt": "orchids velamen aerial roots",
    },
}
# Words that occur in exactly one user's documents.
MARKERS = {
    "apiarist": ("varroa", "sourdough"),
    "mariner": ("fresnel", "caldera"),
    "botanist": ("grandmaster", "velamen"),
}


def _files_of(platform: Any, batch_id: str) -> list[Any]:
    with platform.engine.connect() as conn:
        return list(conn.execute(select(files).where(files.c.batch_id == batch_id)).mappings())


def _stage_jobs(platform: Any, stage: str, key: str, values: Sequence[str]) -> list[Any]:
    """The jobs of ``stage`` whose payload's ``key`` is one of ``values``."""
    with platform.engine.connect() as conn:
        return list(
            conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.payload, jobs.c.attempts).where(
                    jobs.c.stage == stage, jobs.c.payload[key].as_string().in_(list(values))
                )
            ).mappings()
        )


def _unfinished(platform: Any, file_ids: Sequence[str]) -> list[str]:
    """What is still missing or not final among these files' stage jobs."""
    left = []
    for stage in FILE_STAGES:
        found = _stage_jobs(platform, stage, "file_id", file_ids)
        if len(found) < len(file_ids):
            left.append(f"{stage}: {len(found)}/{len(file_ids)} jobs")
        left += [
            f"{r['id']}: {r['status']} (attempts {r['attempts']})"
            for r in found
            if r["status"] not in s.TERMINAL
        ]
    return left


def _wait_settled(platform: Any, file_ids: Sequence[str], timeout: float) -> None:
    try:
        eventually(lambda: not _unfinished(platform, file_ids), timeout=timeout, interval=0.5)
    except AssertionError:
        left = _unfinished(platform, file_ids)
        raise AssertionError(f"not settled in {timeout}s: {len(left)} left, {left[:20]}") from None


def _chord_body(platform: Any, batch_id: str, timeout: float = 30) -> list[Any]:
    """The batch's chord-body jobs, once they are final (or as they are after ``timeout``).

    Not required to exist: the chord's counter lives in Redis, and when it is lost (another
    test session sharing the Redis DB deletes or flushes it) the body never fires; the batch
    completes in Postgres regardless. When it does fire, it must fire once and change nothing.
    """

    def settled() -> list[Any]:
        rows = _stage_jobs(platform, COMPLETE_BATCH, "batch_id", [batch_id])
        return rows if rows and all(r["status"] in s.TERMINAL for r in rows) else []

    try:
        return list(eventually(settled, timeout=timeout, interval=0.5))
    except AssertionError:
        return _stage_jobs(platform, COMPLETE_BATCH, "batch_id", [batch_id])


def _assert_complete_once(platform: Any, batch_id: str, n: int, *, timeout: float) -> list[Any]:
    """The batch completed with ``n`` ready files, every stage ran once per file, one event."""
    batch = completed(platform, batch_id, timeout, interval=0.5)
    assert (batch["total"], batch["terminal"], batch["ready"]) == (n, n, n), dict(batch)
    assert (batch["failed"], batch["cancelled"]) == (0, 0), dict(batch)
    rows = _files_of(platform, batch_id)
    file_ids = [r["id"] for r in rows]
    assert len(rows) == n
    assert Counter(r["status"] for r in rows) == {"ready": n}
    # Let every stage job and the chord body settle before counting: a late duplicate would show.
    _wait_settled(platform, file_ids, timeout=120)
    body = _chord_body(platform, batch_id)
    assert [r["status"] for r in body] in ([], [s.SUCCEEDED]), body
    for stage in FILE_STAGES:
        found = _stage_jobs(platform, stage, "file_id", file_ids)
        per_file = Counter(r["payload"]["file_id"] for r in found)
        assert set(per_file) == set(file_ids), stage
        assert all(c == 1 for c in per_file.values()), (stage, [f for f, c in per_file.items() if c > 1])
        assert Counter(r["status"] for r in found) == {s.SUCCEEDED: n}, stage
    assert completed_events(platform, batch_id) == 1
    assert batch_row(platform, batch_id)["terminal"] == n  # nothing counted twice after completion
    with platform.engine.connect() as conn:
        owning = conn.execute(
            select(func.count(func.distinct(chunks.c.file_id))).where(chunks.c.file_id.in_(file_ids))
        ).scalar_one()
        n_chunks = conn.execute(select(func.count()).where(chunks.c.file_id.in_(file_ids))).scalar_one()
    n_embedded = embedded_chunks(platform, file_ids)
    assert owning == n
    assert n_chunks == n_embedded == sum(r["chunk_count"] for r in rows)
    return rows


@pytest.mark.timeout(900)
def test_100_file_batch_completes_once_and_runs_each_stage_once_per_file(
    platform: Any, worker: Any, tag: str
) -> None:
    batch_id = process_batch(platform, tag, docs(100, tag))
    rows = _assert_complete_once(platform, batch_id, 100, timeout=720)
    assert all(r["chunk_count"] >= 1 and r["text"] for r in rows)


def _in_threads(calls: Sequence[Callable[[], str]]) -> list[str]:
    """Run ``calls`` in threads released together; their results, in order (errors re-raised)."""
    barrier = threading.Barrier(len(calls))
    results: list[str | BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a submitting thread hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [str(r) for r in results]


@pytest.mark.timeout(600)
def test_three_users_batches_submitted_at_once_complete_separately_and_search_stays_within_the_user(
    platform: Any, worker: Any, tag: str
) -> None:
    owners = {user: f"{tag}-{user}" for user in USERS}
    # Each user's batch: their two topic documents, plus a different number of short notes.
    items = {
        user: [Upload(name, text.encode()) for name, text in docs.items()]
        + [Upload(f"note-{i}.txt", f"Diary entry {i} of the {user}.".encode()) for i in range(2 + k)]
        for k, (user, docs) in enumerate(USERS.items())
    }
    users = list(USERS)
    calls: list[Callable[[], str]] = [
        (lambda u=u: process_batch(platform, owners[u], items[u])) for u in users
    ]
    batch_ids = dict(zip(users, _in_threads(calls), strict=True))
    assert len(set(batch_ids.values())) == 3

    file_ids: dict[str, set[str]] = {}
    for user in users:
        rows = _assert_complete_once(platform, batch_ids[user], len(items[user]), timeout=300)
        assert {r["owner"] for r in rows} == {owners[user]}
        assert {r["name"] for r in rows} == {i.name for i in items[user]}
        file_ids[user] = {r["id"] for r in rows}
        assert batch_row(platform, batch_ids[user])["owner"] == owners[user]
    with platform.engine.connect() as conn:
        for user in users:
            chunk_owners = set(
                conn.execute(
                    select(chunks.c.owner).where(chunks.c.file_id.in_(list(file_ids[user])))
                ).scalars()
            )
            assert chunk_owners == {owners[user]}

    for user in users:
        for name, query in QUERIES[user].items():
            hits = search(platform, query, owner=owners[user])
            assert hits and hits[0].name == name, (user, query, [(h.name, round(h.score, 3)) for h in hits])
            assert {h.file_id for h in hits} <= file_ids[user]
        for other in users:
            if other == user:
                continue
            # The other users' own words, asked as this user: only this user's files come back.
            for query in QUERIES[other].values():
                hits = search(platform, query, owner=owners[user], limit=50)
                assert {h.file_id for h in hits} <= file_ids[user], (user, query)
                text = " ".join(h.text.lower() for h in hits)
                assert not any(word in text for word in MARKERS[other]), (user, query)


# --- S3 -------------------------------------------------------------------------------------------

BUCKET = "conveyor-scale-test"
FAKE_KEY = "testing"


@pytest.fixture
def s3_settings(platform: Any, worker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Settings]:
    """moto's S3 server, and the platform's settings pointing the files family at it.

    The worker runs in this process and reads ``platform.settings`` on every call, so swapping
    the settings object (restored afterwards) moves both uploads and stages onto S3.
    """
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        settings = S3Settings(
            bucket=BUCKET,
            endpoint_url=f"http://{host}:{port}",
            access_key=FAKE_KEY,
            secret_key=FAKE_KEY,
            connect_timeout=2,
            read_timeout=10,
        )
        boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=FAKE_KEY,
            aws_secret_access_key=FAKE_KEY,
        ).create_bucket(Bucket=BUCKET)
        current = platform.settings
        monkeypatch.setattr(
            platform,
            "settings",
            current.model_copy(update={"files": current.files.model_copy(update={"s3": settings})}),
        )
        yield settings
    finally:
        monkeypatch.undo()
        server.stop()


def _s3_client(settings: S3Settings) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key,
        aws_secret_access_key=settings.secret_key,
    )


@pytest.mark.timeout(300)
def test_batch_stored_in_s3_reaches_ready_and_a_missing_object_fails_its_file(
    platform: Any, worker: Any, tag: str, s3_settings: S3Settings
) -> None:
    items = [
        Upload("alpine-glaciers.pdf", (FIXTURES / "alpine-glaciers.pdf").read_bytes()),
        Upload("tidal-energy.docx", (FIXTURES / "tidal-energy.docx").read_bytes()),
        Upload("beekeeping.html", (FIXTURES / "beekeeping.html").read_bytes()),
        Upload("lighthouse-keepers.md", (FIXTURES / "lighthouse-keepers.md").read_bytes()),
        Upload("sourdough-bread.txt", (FIXTURES / "sourdough-bread.txt").read_bytes()),
    ]
    batch_id = process_batch(platform, tag, items)
    rows = _assert_complete_once(platform, batch_id, len(items), timeout=240)
    client = _s3_client(s3_settings)
    for row in rows:
        assert row["content_ref"].startswith(f"s3://{BUCKET}/{tag}/"), row["content_ref"]
        key = row["content_ref"][len(f"s3://{BUCKET}/") :]
        data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        original = next(i.data for i in items if i.name == row["name"])
        assert data == original
    hits = search(platform, "glacier", owner=tag)
    assert hits and hits[0].name == "alpine-glaciers.pdf", [(h.name, round(h.score, 3)) for h in hits]

    # The object vanishes between upload and confirm: a permanent failure, on the first attempt.
    file_id = upload(platform, tag, Upload("gone.txt", TOPICS["chess"].encode()))
    ref = file_row(platform, file_id)["content_ref"]
    assert ref.startswith(f"s3://{BUCKET}/")
    client.delete_object(Bucket=BUCKET, Key=ref[len(f"s3://{BUCKET}/") :])
    assert confirm(platform, file_id) is True
    gone = eventually(lambda: (f := file_row(platform, file_id))["status"] == "failed" and f, timeout=60)
    assert (gone["failed_stage"], gone["error_type"]) == ("extract", "ContentMissing")
    extract = _stage_jobs(platform, "conveyor.files.extract", "file_id", [file_id])
    assert [(r["status"], r["attempts"]) for r in extract] == [(s.DEAD, 1)]
