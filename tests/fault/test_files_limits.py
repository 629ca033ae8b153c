"""The files family at its limits, with real prefork workers: an upload killed half way
leaves nothing behind once swept; a hostile document never grows a worker's memory past
its bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.delivery.procs import service_env
from pipelines.files import Upload, confirm, upload
from tasks.files.models import files
from tasks.files.stages import _settings, sweep_uploads
from tasks.files.storage import LocalStorage
from tests.fault.conftest import Spawn, children, memory_of
from tests.helpers import eventually

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault]

TEXT = b"The lighthouse keeper trimmed the wick and polished the Fresnel lens before the fog rolled in."


def _file(platform: Any, file_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(files).where(files.c.id == file_id)).mappings().one_or_none()


def test_an_upload_killed_half_way_is_swept_with_its_object(platform: Any, tag: str, tmp_path: Path) -> None:
    fifo = tmp_path / "slow-source"
    os.mkfifo(fifo)
    script = textwrap.dedent(
        f"""
        from config.celery_app import platform
        from pipelines.files import Upload, upload
        upload(platform, {tag!r}, Upload.from_path({str(fifo)!r}, name="half.txt"))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=service_env(platform.settings))
    with fifo.open("wb") as writer:
        writer.write(b"x" * (3 * 1024 * 1024))  # some content arrives, then the uploader dies
        writer.flush()
        with platform.engine.connect() as conn:
            row = eventually(
                lambda: conn.execute(select(files).where(files.c.owner == tag)).mappings().one_or_none(),
                timeout=30,
            )
        assert row["status"] == "uploading"
        time.sleep(0.5)
        proc.kill()
        proc.wait(10)
    root = _settings().files_storage_dir()
    leftovers = [p for p in root.rglob("*") if tag in str(p) and p.is_file()]
    assert sweep_uploads(older_than=0) >= 1
    assert _file(platform, row["id"]) is None
    assert not [p for p in leftovers if p.exists()]
    assert not [p for p in root.rglob("*") if tag in str(p) and p.is_file()]


def _tree_html(megabytes: int) -> bytes:
    """Ordinary-looking HTML whose parse tree dwarfs its bytes (lxml: ~40 bytes of input per
    element, several hundred bytes per node)."""
    row = b"<div><span>a</span><span>b</span><i>c</i></div>\n"
    return b"<!doctype html><html><body>" + row * (megabytes * 1024 * 1024 // len(row)) + b"</body></html>"


def _words(megabytes: float) -> bytes:
    words = b"beekeeper lighthouse sourdough volcano grandmaster orchid basalt caldera. ".split(b" ")
    line = b" ".join(words * 4) + b"\n"
    return line * int(megabytes * 1024 * 1024 // len(line))


def test_hostile_documents_never_grow_a_worker_past_its_memory_bound(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    max_bytes = _settings().files.max_bytes
    bound = max(2 * max_bytes, 256 * 1024 * 1024)
    worker = spawn(concurrency=1)
    warm = upload(platform, tag, Upload("warm.txt", TEXT))
    confirm(platform, warm)  # imports, pools and caches are warm before the idle figure
    eventually(lambda: _file(platform, warm)["status"] == "ready", timeout=60)
    (pool,) = eventually(lambda: children(worker.pid) or None, timeout=10)
    idle = memory_of(pool, "VmRSS")

    # Stored content larger than the limit (replaced behind the upload's back): refused by
    # its stored size, never read.
    swapped = upload(platform, tag, Upload("swapped.txt", TEXT))
    path = LocalStorage(_settings().files_storage_dir())._path(_file(platform, swapped)["content_ref"])
    with path.open("r+b") as handle:
        handle.truncate(400 * 1024 * 1024)
    documents = {
        swapped: ("FileTooLarge", "over the"),
        upload(platform, tag, Upload("tree.html", _tree_html(20))): ("DocumentTooComplex", "too complex"),
        upload(platform, tag, Upload("long.txt", _words(4))): None,  # ordinary: must succeed
    }
    for file_id in documents:
        confirm(platform, file_id)
    for file_id, expected in documents.items():
        row = eventually(
            lambda f=file_id: (r := _file(platform, f))["status"] in ("ready", "failed") and r, timeout=120
        )
        if expected is None:
            assert row["status"] == "ready", (row["error_type"], row["error"])
        else:
            assert (row["status"], row["error_type"]) == ("failed", expected[0]), row["error"]
            assert expected[1] in row["error"]
    grown = memory_of(pool, "VmHWM") - idle
    print(f"pool_peak_growth_mib={grown / 2**20:.0f} bound_mib={bound / 2**20:.0f}")
    assert grown <= bound, f"pool process grew by {grown / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)"
    assert children(worker.pid) == [pool]  # the same pool process did all of it: none died
