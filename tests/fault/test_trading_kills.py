"""The trading family with real prefork workers: a SIGKILL mid-import resumes from the
last committed page, a score preempted by its user's import resumes without telling a
trade twice, and no log line of any worker carries a broker token or the HMAC secret."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_import
from pipelines.trading.peers import TradingPeers
from tasks.trading import tables as t
from tests.fault.conftest import Spawn, kill_group
from tests.helpers import eventually, job_row
from tests.integration.trading_support import (
    SECRET,
    TOKEN_KEY,
    connected_user,
    count,
    days_ago,
    events,
    reflect_events,
    started_peers,
    trading_config,
    trading_settings,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]


@pytest.fixture
def peers() -> Iterator[TradingPeers]:
    with started_peers() as running:
        yield running


def _env(peers: TradingPeers, **changes: Any) -> dict[str, str]:
    return {"CONVEYOR_TRADING": json.dumps(trading_config(peers, **changes))}


def _import_row(platform: Any, job_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(t.imports).where(t.imports.c.job_id == job_id)).mappings().first()


def test_sigkill_mid_import_resumes_from_the_last_committed_page(
    platform: Any, spawn: Spawn, peers: TradingPeers, tag: str
) -> None:
    with trading_settings(platform, peers):
        connected_user(platform, peers, tag, n=100)
        peers.broker.faults(page_size=10, latency_ms=300)
        first = spawn(env=_env(peers))
        handle = submit_import(platform, tag)
        eventually(lambda: (_import_row(platform, handle.id) or {"pages": 0})["pages"] >= 3, timeout=60)
        kill_group(first)
        committed = _import_row(platform, handle.id)["pages"]
        spawn(env=_env(peers))
        assert handle.wait(90) == s.SUCCEEDED
    result = job_row(platform, handle.id)["result"]
    assert (result["fetched"], result["stored"], result["pages"]) == (100, 100, 10)
    assert count(platform, t.trades, tag) == 100
    pages = [e["page"] for e in peers.broker.log() if e["user"] == tag]
    for page in range(1, committed + 1):
        assert pages.count(page) == 1, pages  # a committed page is never fetched again
    assert sorted(set(pages)) == list(range(1, 11)) and len(pages) <= 11
    progress = events(platform, handle.id, "import.progress")
    assert len(progress) == 10 and progress[-1]["fetched"] == 100


def test_a_score_preempted_by_its_users_import_resumes_and_tells_each_trade_once(
    platform: Any, spawn: Spawn, peers: TradingPeers, tag: str
) -> None:
    env = _env(peers, score_batch=20)
    with trading_settings(platform, peers, score_batch=20):
        connected_user(platform, peers, tag, n=120)
        peers.coach.faults(latency_ms=15)
        spawn(env=env, concurrency=2)
        imported = submit_import(platform, tag)
        assert imported.wait(60) == s.SUCCEEDED
        score = platform.job(job_row(platform, imported.id)["result"]["score_job"])

        def scored_batches() -> int:
            with platform.engine.connect() as conn:
                row = conn.execute(select(t.scores.c.batches).where(t.scores.c.job_id == score.id)).first()
            return 0 if row is None else int(row[0])

        eventually(lambda: scored_batches() >= 1, timeout=60)
        again = submit_import(platform, tag, since=days_ago(25).date())  # another window: not a duplicate
        assert again.wait(60) == s.SUCCEEDED
        assert score.wait(120) == s.SUCCEEDED
    topics = [e.topic for e in score.events()[0]]
    assert "job.preempted" in topics, topics
    # The preemptor's own score (a wider window, untagged trades only) may tell some of
    # the trades; across both scores and all their attempts, each trade is told once.
    told = [e["tradeId"] for e in reflect_events(platform, tag)]
    assert len(told) == 120 and len(set(told)) == 120
    assert events(platform, score.id, "coach.reflect")
    row = job_row(platform, score.id)
    assert row["attempts"] - row["uncounted"] == 1


def test_no_worker_log_line_carries_a_token_or_the_hmac_secret(
    platform: Any, spawn: Spawn, peers: TradingPeers, tag: str, tmp_path: Path
) -> None:
    with trading_settings(platform, peers):
        token, rows = connected_user(platform, peers, tag, n=30)
        spawn(env=_env(peers))
        peers.broker.faults(storm=1, retry_after_s=0.1)
        peers.coach.faults(fail_5xx=1)
        ok = submit_import(platform, tag)
        assert ok.wait(60) == s.SUCCEEDED
        assert platform.job(job_row(platform, ok.id)["result"]["score_job"]).wait(60) == s.SUCCEEDED
        peers.broker.set_user(tag, "coinbase", f"rotated-{tag}", rows)
        refused = submit_import(platform, tag, since=days_ago(29).date())
        assert refused.wait(60) == s.DEAD
    assert peers.coach.stats()["rejected"] == {}  # a retried AI request was signed afresh
    text = "".join(p.read_text(errors="replace") for p in tmp_path.glob("worker-*.log"))
    assert tag in text  # the logs are there, and they name the user
    for secret in (token, SECRET, TOKEN_KEY):
        assert secret not in text
    with platform.engine.connect() as conn:
        stored = conn.execute(
            select(t.connections.c.token_enc).where(t.connections.c.user_id == tag)
        ).scalar_one()
    assert token not in stored
