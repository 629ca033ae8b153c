"""The embedded default (SQLite) under one big document: a 100-file ``conveyor files
submit`` beside a DOCX that passes the unpack caps and yields over 20 MB of text. No
stage, relay, heartbeat or CLI transaction holds SQLite's single writer for more than 2 s
(every process logs any that does), and the CLI never shows a traceback."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from conveyor.delivery.procs import service_env
from conveyor.store.db.engine import reading
from tasks.files.models import batches, files
from tasks.files.stages import _settings
from tests.fault.conftest import Spawn, children, memory_of
from tests.helpers import eventually

pytestmark = [pytest.mark.timeout(420), pytest.mark.fault, pytest.mark.sqlite]

SLOW = "SQLite write lock held for"
WORDS = [
    "beekeeper",
    "inspects",
    "brood",
    "frames",
    "lighthouse",
    "keeper",
    "trims",
    "the",
    "wick",
    "sourdough",
    "starter",
    "ferments",
]


def _big_docx(path: Path, megabytes: int) -> None:
    """A DOCX that passes the unpack caps (its XML compresses about 2:1, far under the ratio
    limit, and unpacks to well under the absolute cap) and yields ``megabytes`` of text:
    the seed's "one big document" as a user's word processor would write it."""
    import io
    import random
    import zipfile
    from xml.sax.saxutils import escape

    import docx

    rng = random.Random(11)
    vocabulary = WORDS + [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10))) for _ in range(4000)
    ]
    paragraphs, size = [], 0
    while size < megabytes * 1024 * 1024:
        text = " ".join(rng.choices(vocabulary, k=1500)) + "."
        paragraphs.append(f'<w:p><w:r><w:t xml:space="preserve">{escape(text)}</w:t></w:r></w:p>')
        size += len(text) + 2
    template = io.BytesIO()
    docx.Document().save(template)
    with zipfile.ZipFile(template) as source:
        xml = source.read("word/document.xml").decode()
        body = xml.index("<w:body>") + len("<w:body>")
        xml = xml[:body] + "".join(paragraphs) + xml[body:]
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                content = xml.encode() if info.filename == "word/document.xml" else source.read(info)
                target.writestr(info.filename, content)


def _probe_writer(db: str, stop: threading.Event, waits: list[float]) -> None:
    """How long a newcomer waits for the writer, sampled while everything runs."""
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)
    while not stop.is_set():
        started = time.monotonic()
        conn.execute("BEGIN IMMEDIATE")
        waits.append(time.monotonic() - started)
        conn.execute("ROLLBACK")
        time.sleep(0.2)
    conn.close()


def test_a_big_document_beside_a_100_file_submit_never_holds_the_writer_long(
    on_sqlite: Any, spawn: Spawn, tmp_path: Path, tag: str
) -> None:
    platform = on_sqlite
    docs = tmp_path / "docs"
    docs.mkdir()
    _big_docx(docs / "000-big.docx", 21)
    for i in range(1, 100):
        (docs / f"{i:03d}.txt").write_text(f"Note {i}: " + " ".join(WORDS[i % 5 :] * 3))
    paths = sorted(docs.iterdir())

    long_limits = {
        "CONVEYOR_DEFAULT_TIME_LIMIT": "300",
        "CONVEYOR_DEFAULT_SOFT_TIME_LIMIT": "280",
        "CONVEYOR_VISIBILITY_TIMEOUT": "600",
    }
    worker = spawn(concurrency=2, settings=platform.settings, env=long_limits)
    pool = eventually(lambda: len(found := children(worker.pid)) == 2 and found, timeout=10)
    idle = {pid: memory_of(pid, "VmRSS") for pid in pool}
    db = str(platform.engine.url.database)
    stop, waits = threading.Event(), []
    prober = threading.Thread(target=_probe_writer, args=(db, stop, waits), daemon=True)
    prober.start()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor",
            "files",
            "submit",
            "--user",
            tag,
            "--timeout",
            "300",
            "--wait",
            "60",
        ]
        + [str(p) for p in paths],
        env=service_env(platform.settings),
        capture_output=True,
        text=True,
        timeout=360,
    )
    stop.set()
    prober.join(10)
    output = cli.stdout + cli.stderr
    assert cli.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "database is locked" not in output
    with platform.engine.connect() as conn:
        batch = conn.execute(select(batches).where(batches.c.owner == tag)).mappings().one()
        big = (
            conn.execute(select(files).where(files.c.owner == tag, files.c.name == "000-big.docx"))
            .mappings()
            .one()
        )
    assert (batch["status"], batch["total"], batch["ready"]) == ("completed", 100, 100)
    assert len(big["text"]) >= 20 * 1024 * 1024 and big["chunk_count"] > 10_000
    logs = "".join(p.read_text() for p in tmp_path.glob("worker-*.log"))
    assert SLOW not in logs, [line for line in logs.splitlines() if SLOW in line]
    assert SLOW not in output
    assert waits and max(waits) < 10, max(waits)
    bound = max(2 * _settings().files.max_bytes, 256 * 1024 * 1024)
    grown = {pid: memory_of(pid, "VmHWM") - idle[pid] for pid in pool}
    print(f"max_writer_wait_s={max(waits):.2f} pool_peak_growth_mib={max(grown.values()) / 2**20:.0f}")
    assert max(grown.values()) <= bound, {pid: f"{g / 2**20:.0f} MiB" for pid, g in grown.items()}


def test_messy_documents_get_a_clear_answer_on_sqlite(on_sqlite: Any, spawn: Spawn, tag: str) -> None:
    from pipelines.files import Upload, batch_status, process_batch
    from tests.integration.files_support import MESSY, check_messy, completed

    spawn(concurrency=2, settings=on_sqlite.settings)
    batch_id = process_batch(on_sqlite, tag, [Upload(name, data) for name, data, _ in MESSY])
    completed(on_sqlite, batch_id, timeout=120)
    ids = {f["name"]: f["id"] for f in batch_status(on_sqlite, batch_id)["files"]}
    check_messy(on_sqlite, tag, ids)


@pytest.mark.parametrize("last", [False, True], ids=["then-retried", "on-its-last-attempt"])
def test_a_chunk_attempt_killed_while_staging_leaves_no_chunks_behind(
    on_sqlite: Any, spawn: Spawn, tag: str, last: bool
) -> None:
    """SIGKILL half way through staging. Retried: the next attempt releases what the dead
    one staged, and the file ends ``ready`` with its chunks once. On the job's last
    attempt: nothing will adopt them, and the reconciler's sweep drains them all."""
    from conveyor.store.db.schema import jobs
    from pipelines.files import Upload, confirm, upload
    from tasks.files import flow
    from tasks.files.models import chunks, staging
    from tests.fault.conftest import kill_group

    platform = on_sqlite
    rng = random.Random(5)
    text = " ".join(rng.choices(WORDS + [f"w{i}" for i in range(3000)], k=1_600_000))  # ~9 MB
    file_id = upload(platform, tag, Upload("long-notes.txt", text.encode()))
    first = spawn(concurrency=1, settings=platform.settings)
    assert confirm(platform, file_id)

    eventually(lambda: _status(platform, file_id) == "chunking", timeout=120)

    def staged_not_adopted() -> Any:
        with reading(platform.engine) as conn:  # a WAL reader: never waits for the writer
            row = conn.execute(
                select(staging.c.key, staging.c.job_id).where(staging.c.file_id == file_id)
            ).first()
            staged = (
                row is not None
                and conn.execute(select(func.count()).where(chunks.c.file_id == row.key)).scalar()
            )
        return row if staged else None

    def stopped_while_staging() -> Any:
        """Half way through staging, frozen (SIGSTOP) so that it cannot go on, and seen
        still half way once frozen: then the kill lands there."""
        if staged_not_adopted() is None:
            return None
        os.killpg(first.pid, signal.SIGSTOP)
        row = staged_not_adopted()
        if row is None:  # it adopted them meanwhile
            os.killpg(first.pid, signal.SIGCONT)
        return row

    key, job_id = eventually(stopped_while_staging, timeout=120, interval=0.02)
    kill_group(first)
    if last:  # the attempt that died was the job's last one
        with platform.engine.begin() as conn:
            counted = jobs.c.attempts - jobs.c.uncounted
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(max_attempts=counted))
    with reading(platform.engine) as conn:
        left = conn.execute(select(func.count()).where(chunks.c.file_id == key)).scalar_one()
        status = conn.execute(select(files.c.status).where(files.c.id == file_id)).scalar_one()
    assert left > 0 and status == "chunking"  # killed half way: staged, not adopted

    spawn(concurrency=1, settings=platform.settings)  # its relay takes over the lost attempt
    if last:
        eventually(lambda: _status(platform, file_id) == "failed", timeout=120)
        assert flow.sweep_staging(platform.engine, stale_after=3600) <= 1  # (or a reconcile got there first)
    else:
        eventually(lambda: _status(platform, file_id) == "ready", timeout=120)
    with reading(platform.engine) as conn:
        kept = conn.execute(select(func.count()).select_from(chunks)).scalar_one()
        ordinals = conn.execute(select(func.count(func.distinct(chunks.c.ordinal)))).scalar_one()
        count = conn.execute(select(files.c.chunk_count).where(files.c.id == file_id)).scalar_one()
        assert conn.execute(select(func.count()).select_from(staging)).scalar_one() == 0
    assert kept == (0 if last else count) and kept == ordinals  # every chunk once, none staged
    print(f"staged_chunks_left_by_the_kill={left} chunks_kept={kept}")


def _status(platform: Any, file_id: str) -> str:
    with reading(platform.engine) as conn:
        return str(conn.execute(select(files.c.status).where(files.c.id == file_id)).scalar_one())
