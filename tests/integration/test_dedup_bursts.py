"""500 concurrent identical submits from threads and processes, with the holder gated (no
worker runs in this module, so the holder stays non-terminal throughout)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from conveyor.dedup import Dedup
from conveyor.delivery.procs import service_env
from conveyor.store.db.schema import dedup_keys, jobs
from tests.integration.burst import TTL, burst

pytestmark = pytest.mark.timeout(300)

TOTAL, PROCS, PER_PROC, THREADS = 500, 2, 150, 10


def _burst_everywhere(platform: Any, mode: str, tag: str) -> list[dict[str, Any]]:
    """200 submits from 20 threads here, 150 from 10 threads in each of 2 processes."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.burst",
                mode,
                str(PER_PROC),
                str(THREADS),
                tag,
                str(k * 1000),
            ],
            env=service_env(platform.settings),
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(1, PROCS + 1)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    platform.redis.rpush(f"{tag}:go", *["go"] * PROCS)
    results = burst(platform, mode, TOTAL - PROCS * PER_PROC, 20, tag, offset=0)
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0
        results += json.loads(out.strip().splitlines()[-1])
    assert len(results) == TOTAL
    return results


def _jobs_for(platform: Any, tag: str) -> list[Any]:
    with platform.engine.connect() as conn:
        return list(
            conn.execute(
                select(jobs).where(jobs.c.dedup_key == f"conveyor.demo.effect:burst:{tag}")
            ).mappings()
        )


def test_simple_burst_creates_exactly_one_job(platform: Any, tag: str) -> None:
    results = _burst_everywhere(platform, "simple", tag)
    created = _jobs_for(platform, tag)
    assert len(created) == 1
    assert {r["job"] for r in results} == {created[0]["id"]}
    assert sum(not r["dup"] for r in results) == 1


def test_throttle_burst_creates_one_job_per_window(platform: Any, tag: str) -> None:
    results = _burst_everywhere(platform, "throttle", tag)
    created = sorted((r for r in results if not r["dup"]), key=lambda r: r["at"])
    assert len(created) == len(_jobs_for(platform, tag)) >= 1
    ttl_ms = int(TTL * 1000)
    starts = [int(r["at"] * 1000) for r in created]
    assert all(b - a >= ttl_ms for a, b in itertools.pairwise(starts)), starts
    start_of = {r["job"]: int(r["at"] * 1000) for r in created}
    for r in results:
        assert int(r["at"] * 1000) < start_of[r["job"]] + ttl_ms  # every hit inside its holder's window


def test_debounce_burst_keeps_one_job_with_the_highest_sequence_payload(platform: Any, tag: str) -> None:
    results = _burst_everywhere(platform, "debounce", tag)
    created = _jobs_for(platform, tag)
    assert len(created) == 1
    assert {r["job"] for r in results} == {created[0]["id"]}
    last = max(results, key=lambda r: r["seq"])
    assert created[0]["payload"]["sleep"] == last["i"] / 10**6
    assert created[0]["dedup_seq"] == last["seq"]


def test_rolled_back_submit_leaves_no_dedup_key(platform: Any, tag: str) -> None:
    policy = Dedup(mode="simple", key="rb:{note}")
    with Session(platform.engine) as session:
        first = platform.submit("conveyor.demo.effect", {"note": tag}, dedup=policy, session=session)
        session.rollback()
    with platform.engine.connect() as conn:
        n = conn.execute(
            select(func.count()).select_from(dedup_keys).where(dedup_keys.c.key == f"rb:{tag}")
        ).scalar_one()
    assert n == 0
    again = platform.submit("conveyor.demo.effect", {"note": tag}, dedup=policy)
    assert not again.deduplicated and again.id != first.id
