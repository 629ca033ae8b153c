"""The seed's chaos list for the trading family, with real prefork workers: Redis restarted
empty mid-flow duplicates nothing (counted in SQL), a 429 storm of 30 costs one counted
attempt, and the AI coach down dead-letters the score after 3 attempts naming the endpoint.
(A SIGKILL mid-import: ``test_trading_kills.py``; the fan-out fired twice:
``tests/integration/test_trading_sim_digest.py``.)"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_digest, submit_import
from pipelines.trading.peers import TradingPeers
from tasks.trading import tables as t
from tests.fault.conftest import Spawn
from tests.fault.servers import PrivateRedis, private_redis
from tests.helpers import bound_to, eventually, job_row
from tests.integration.trading_support import (
    connected_user,
    events,
    reflect_events,
    started_peers,
    trading_config,
    trading_settings,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault]


@pytest.fixture
def peers() -> Iterator[TradingPeers]:
    with started_peers() as running:
        yield running


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    server = private_redis()
    yield server
    server.destroy()


def _env(peers: TradingPeers, **extra: str) -> dict[str, str]:
    return {"CONVEYOR_TRADING": json.dumps(trading_config(peers)), **extra}


def _score_of(platform: Any, import_id: str) -> Any:
    return platform.job(job_row(platform, import_id)["result"]["score_job"])


def _scored_batches(platform: Any, users: list[str]) -> int:
    with platform.engine.connect() as conn:
        query = select(func.coalesce(func.sum(t.scores.c.batches), 0)).where(t.scores.c.user_id.in_(users))
        return int(conn.execute(query).scalar_one())


def test_redis_restarted_empty_mid_flow_duplicates_nothing(
    platform: Any, spawn: Spawn, peers: TradingPeers, redis_server: PrivateRedis, tag: str
) -> None:
    users = [f"{tag}-{i}" for i in range(3)]
    bound_services = bound_to(platform, platform.settings.database_url, redis_url=redis_server.url)
    with bound_services as bound, trading_settings(bound, peers, score_batch=10):
        for user in users:
            connected_user(bound, peers, user, n=60)
        peers.broker.faults(page_size=10, latency_ms=120)
        peers.coach.faults(latency_ms=5)
        env = _env(peers)
        env["CONVEYOR_TRADING"] = json.dumps(trading_config(peers, score_batch=10))
        spawn(settings=bound.settings, env=env, concurrency=2)
        spawn(settings=bound.settings, env=env, concurrency=2)
        imports = [submit_import(bound, user) for user in users]

        def pages() -> int:
            with bound.engine.connect() as conn:
                query = select(func.coalesce(func.sum(t.imports.c.pages), 0)).where(
                    t.imports.c.user_id.in_(users)
                )
                return int(conn.execute(query).scalar_one())

        eventually(lambda: pages() >= 4, timeout=60)
        redis_server.stop()  # SIGKILL, no persistence: every queue and key is gone
        redis_server.start()
        for handle in imports:
            assert handle.wait(120) == s.SUCCEEDED
        eventually(lambda: _scored_batches(bound, users) >= 2, timeout=60)
        redis_server.stop()  # again, while the scores run
        redis_server.start()
        scores = [_score_of(bound, handle.id) for handle in imports]
        for score in scores:
            assert score.wait(120) == s.SUCCEEDED
        start = dt.date.today() - dt.timedelta(days=21)
        digests = [submit_digest(bound, user, start, start + dt.timedelta(days=7)) for user in users]
        for handle in digests:
            assert handle.wait(60) == s.SUCCEEDED
    with platform.engine.connect() as conn:
        for user in users:
            trades = conn.execute(select(func.count()).where(t.trades.c.user_id == user)).scalar_one()
            assert trades == 60
            tags = conn.execute(
                select(t.tags.c.trade_id, t.tags.c.label, func.count())
                .where(t.tags.c.user_id == user)
                .group_by(t.tags.c.trade_id, t.tags.c.label)
            ).all()
            assert tags and all(n == 1 for _, _, n in tags)
            assert len({trade for trade, _, _ in tags}) == 60
            told = [e["tradeId"] for e in reflect_events(platform, user)]
            assert len(told) == 60 and len(set(told)) == 60  # no trade told twice
            digests_n = conn.execute(select(func.count()).where(t.digests.c.user_id == user)).scalar_one()
            assert digests_n == 1
        # One import, score and digest job per user: nothing ran twice as two jobs.
        stages = conn.execute(
            select(s.jobs.c.stage, func.count())
            .where(
                s.jobs.c.label.in_([f"{kind} {u}" for u in users for kind in ("import", "score", "digest")])
            )
            .group_by(s.jobs.c.stage)
        ).all()
    assert sorted(n for _, n in stages) == [3, 3, 3]
    assert all(len(events(platform, h.id, "digest.ready")) == 1 for h in digests)


def test_a_429_storm_of_30_costs_one_counted_attempt(
    platform: Any, spawn: Spawn, peers: TradingPeers, tag: str
) -> None:
    with trading_settings(platform, peers):
        connected_user(platform, peers, tag, n=40)
        spawn(env=_env(peers, CONVEYOR_RELAY_INTERVAL="0.2"))
        peers.broker.faults(storm=30, retry_after_s=0.05)
        handle = submit_import(platform, tag)
        assert handle.wait(150) == s.SUCCEEDED
    row = job_row(platform, handle.id)
    assert row["attempts"] - row["uncounted"] == 1 and row["uncounted"] == 30 and row["requeues"] == 0
    deferred = [e for e in handle.events()[0] if e.topic == "job.deferred"]
    assert len(deferred) == 30
    assert handle.result["stored"] == 40


def test_the_ai_coach_down_dead_letters_the_score_after_three_attempts(
    platform: Any, spawn: Spawn, peers: TradingPeers, tag: str
) -> None:
    with trading_settings(platform, peers):
        connected_user(platform, peers, tag, n=10)
        spawn(env=_env(peers))
        peers.coach.stop()  # the service killed: connections refused
        imported = submit_import(platform, tag)
        assert imported.wait(60) == s.SUCCEEDED
        score = _score_of(platform, imported.id)
        assert score.wait(90) == s.DEAD
    row = job_row(platform, score.id)
    assert row["attempts"] - row["uncounted"] == 3
    assert "/v1/bias" in row["last_error"] and "AI coach" in row["last_error"]
