"""SQLite has one writer. A stage body that writes early through ``ctx.connection`` holds it
until its completion commits; meanwhile readers, heartbeat threads and the relay must not
queue behind it, and nothing may be taken over because of beats that could not be written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from conveyor.delivery.procs import service_env
from conveyor.store.db import schema as s
from tests.fault.conftest import Spawn
from tests.helpers import effect_count, eventually

pytestmark = [pytest.mark.timeout(180), pytest.mark.sqlite]

HOLD = 8.0  # seconds the long body holds the writer



def _relay_pass(platform: Any) -> dict[str, Any] | None:
    raw = platform.redis.get(f"{platform.settings.key_prefix}relay:pass")
    return json.loads(raw) if raw else None


def test_a_long_body_write_blocks_no_reader_heartbeat_or_relay(
    on_sqlite: Any, spawn: Spawn, tag: str
) -> None:
    platform = on_sqlite
    spawn(concurrency=2, settings=platform.settings)
    other = platform.submit("conveyor.demo.effect", {"note": f"{tag}-other", "sleep": HOLD + 2})
    eventually(lambda: other.status() == s.RUNNING, timeout=60)
    payload = {"note": f"{tag}-long", "write_first": True, "sleep": HOLD}
    long = platform.submit("conveyor.demo.effect", payload)
    eventually(lambda: long.status() == s.RUNNING, timeout=60)
    time.sleep(1.0)  # the body has written: it holds the writer from here on
    cli_started = time.monotonic()
    cli = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "jobs", "list", "--limit", "2"],
        env=service_env(platform.settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    slowest_read = 0.0
    passes: list[dict[str, Any]] = []
    deadline = time.monotonic() + HOLD - 3
    while time.monotonic() < deadline:
        started = time.monotonic()
        assert long.status() == s.RUNNING
        slowest_read = max(slowest_read, time.monotonic() - started)
        seen = _relay_pass(platform)
        if seen and (not passes or seen["at"] != passes[-1]["at"]):
            passes.append(seen)
        time.sleep(0.2)
    out, _ = cli.communicate(timeout=60)
    cli_took = time.monotonic() - cli_started
    assert cli.returncode == 0, out.decode()[-2000:]
    assert cli_took < HOLD - 2, f"`conveyor jobs list` waited {cli_took:.1f}s for the writer"
    assert slowest_read < 1.0, f"a status read waited {slowest_read:.1f}s for the writer"
    assert len(passes) >= 3, f"the relay made {len(passes)} pass(es) while the writer was held"
    assert any(p["outcome"] == "busy" for p in passes)

    assert long.wait(60) == s.SUCCEEDED
    assert other.wait(60) == s.SUCCEEDED
    # Beats skipped while the writer was held took nobody over.
    assert long.row()["attempts"] == 1 and other.row()["attempts"] == 1
    assert effect_count(platform, note=f"{tag}-long") == 1
    assert effect_count(platform, note=f"{tag}-other") == 1
