"""``conveyor top`` as a person runs it (a subprocess on the test services): one reading
with ``--once`` and ``--json`` shows the queues with their waiting and running jobs, the
longest-running jobs with their labels, throughput and dead letters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import conveyor
from conveyor.store.db import schema as s
from tests.helpers import eventually, job_row

pytestmark = pytest.mark.timeout(120)

CONVEYOR = str(Path(sys.executable).parent / "conveyor")


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CONVEYOR, "top", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},  # as wide as a terminal window
    )


def test_top_shows_queues_running_jobs_and_throughput(platform: Any, worker: Any, tag: str) -> None:
    client = conveyor.connect(
        database_url=platform.settings.database_url, redis_url=platform.settings.redis_url
    )
    try:
        done = client.submit("conveyor.demo.square", {"n": 5})
        assert done.wait(30) == s.SUCCEEDED
        slow = client.submit("conveyor.demo.effect", {"note": tag, "sleep": 10}, label=f"slow {tag}")
        later = [client.submit("conveyor.demo.square", {"n": n}, delay=120) for n in range(2)]
        eventually(lambda: job_row(platform, slow.id)["status"] == s.RUNNING, timeout=20)

        reading = top("--json")
        assert reading.returncode == 0, reading.stderr
        state = json.loads(reading.stdout)
        demo = state["queues"]["demo"]
        assert demo["queued"] >= len(later) and demo["running"] >= 1
        assert isinstance(demo["waiting"], int) and state["broker_up"] is True
        assert state["finished"].get("succeeded", 0) >= 1 and state["window_seconds"] == 60
        assert slow.id in [r["id"] for r in state["running"]]

        shown = top("--once", "--rows", "50")
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout
        for expected in (
            "queues",
            "demo",
            "running",
            f"slow {tag}",
            slow.id[:8],
            "succeeded / min",
            "dead letters open",
        ):
            assert expected in text, text
        assert "conveyor.demo.effect" in text
    finally:
        for job in later:
            client.cancel(job.id)
        client.close()
