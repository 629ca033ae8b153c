"""``conveyor_job_runtime_seconds{stage, status}`` (the seed's ``job_duration_ms{job,
status=ok|err}``): ``ok`` when the body returned (the job succeeded or was skipped), ``err``
when it raised a failure of the job (each failed attempt, retried or dead-lettered). A
deferral is not the body's outcome: its attempt is not recorded (nor is a preemption, a
cancellation, a worker's stop or Conveyor's own outage).

Metrics are enabled in a process of their own, as ``tests/unit/test_lazy_metrics.py`` does
(enabling picks prometheus_client's multiprocess mode for the whole process): it declares
the stages, runs them on an in-process worker against this session's Redis and database,
and prints the histogram's samples read from its multiprocess directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = """
import json, sys
from celery.contrib.testing.worker import start_worker
from pydantic import BaseModel
from sqlalchemy import delete

from config.celery_app import platform
from conveyor.errors import Deferred, PermanentError, SkipJob, TransientError
from conveyor.retry import Backoff
from conveyor.store.db.schema import stages

prefix = sys.argv[1]
directory = platform.metrics.enable()
platform.app.loader.import_default_modules()
runs = {}


class Ask(BaseModel):
    ref: str
    fail_times: int = 0


def ok(ctx, p):
    return {"ref": p.ref}


def flaky(ctx, p):
    if ctx.attempt <= p.fail_times:
        raise TransientError(f"failing attempt {ctx.attempt} on purpose")
    return {"attempt": ctx.attempt}


def broken(ctx, p):
    raise PermanentError("broken on purpose")


def skipped(ctx, p):
    raise SkipJob("nothing to do")


def deferring(ctx, p):
    runs[p.ref] = runs.get(p.ref, 0) + 1
    if runs[p.ref] == 1:
        raise Deferred(0.2, "wait a little")
    return {"runs": runs[p.ref]}


fast = {"queue": "demo", "retry": Backoff(base=0.1, cap=0.1), "payload": Ask}
for fn, attempts in ((ok, 1), (flaky, 3), (broken, 2), (skipped, 1), (deferring, 1)):
    platform.stage(prefix + fn.__name__, max_attempts=attempts, **fast)(fn)
try:
    with start_worker(
        platform.app, pool="solo", concurrency=1, perform_ping_check=False, loglevel="WARNING",
        shutdown_timeout=30, queues=["demo"],
    ):
        handles = {
            "ok": [platform.submit(prefix + "ok", {"ref": str(n)}) for n in range(3)],
            "flaky": [platform.submit(prefix + "flaky", {"ref": "f", "fail_times": 2})],
            "broken": [platform.submit(prefix + "broken", {"ref": "b"})],
            "skipped": [platform.submit(prefix + "skipped", {"ref": "s"})],
            "deferring": [platform.submit(prefix + "deferring", {"ref": "d"})],
        }
        statuses = {name: [h.wait(60) for h in hs] for name, hs in handles.items()}
    platform.stop_background()
finally:
    with platform.engine.begin() as conn:
        conn.execute(delete(stages).where(stages.c.name.like(prefix + "%")))
# Imported only now: prometheus_client picks its multiprocess mode when first imported.
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

registry = CollectorRegistry()
MultiProcessCollector(registry, path=str(directory))
samples = [
    {"name": s.name, "labels": s.labels, "value": s.value}
    for family in registry.collect()
    if family.name == "conveyor_job_runtime_seconds"
    for s in family.samples
]
print(json.dumps({"statuses": statuses, "samples": samples}))
"""


def _count(samples: list[dict[str, Any]], stage: str, status: str) -> float:
    return sum(
        s["value"]
        for s in samples
        if s["name"] == "conveyor_job_runtime_seconds_count"
        and s["labels"] == {"stage": stage, "status": status}
    )


def test_runtimes_are_labelled_ok_or_err(platform: Any, tag: str, tmp_path: Path) -> None:
    prefix = f"conveyor.runtime_{tag}."
    env = {**os.environ, "CONVEYOR_METRICS_DIR": str(tmp_path / "metrics")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, prefix], capture_output=True, text=True, env=env, timeout=150
    )
    assert out.returncode == 0, out.stderr[-4000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["statuses"] == {
        "ok": ["succeeded"] * 3,
        "flaky": ["succeeded"],
        "broken": ["dead"],
        "skipped": ["skipped"],
        "deferring": ["succeeded"],
    }
    samples = answer["samples"]
    expected = {
        "ok": (3, 0),
        "flaky": (1, 2),  # two failed attempts, then one that returned
        "broken": (0, 1),  # a permanent error: dead-lettered at its first attempt
        "skipped": (1, 0),
        "deferring": (1, 0),  # the deferred attempt is not recorded
    }
    for name, (ok, err) in expected.items():
        assert (_count(samples, prefix + name, "ok"), _count(samples, prefix + name, "err")) == (ok, err), (
            name
        )
    # The buckets and the sum carry the label too.
    buckets = [s for s in samples if s["name"] == "conveyor_job_runtime_seconds_bucket"]
    assert {s["labels"]["status"] for s in buckets if s["labels"]["stage"].startswith(prefix)} == {
        "ok",
        "err",
    }
    total = [s for s in samples if s["name"] == "conveyor_job_runtime_seconds_sum"]
    assert all(0 <= s["value"] < 30 for s in total)
