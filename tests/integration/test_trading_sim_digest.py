"""The trading family's simulate and digest stages with an in-process worker and the real
peers: a cold sim and its cached copy, a horizon cut at now, the vendor fallback and its
429s (never a dead letter), trades not found; a digest's snapshot, row and event, one per
period, zeros for a quiet user, bad periods, an unreachable store, and the weekly fan-out
fired twice."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.errors import PayloadInvalid
from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_digest, submit_fanout, submit_import, submit_sim
from pipelines.trading.peers import TradingPeers
from pipelines.trading.peers.broker import sample_trades
from tasks.trading import tables as t
from tasks.trading.digests import week_of
from tests.helpers import eventually, job_row
from tests.integration.trading_support import (
    connected_user,
    days_ago,
    events,
    started_peers,
    trades,
    trading_settings,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def peers() -> Iterator[TradingPeers]:
    with started_peers() as running:
        yield running


@pytest.fixture
def trading(platform: Any, peers: TradingPeers, tmp_path: Path) -> Iterator[TradingPeers]:
    for peer in (peers.broker, peers.coach, peers.market):
        peer.faults(clear=True)
    with trading_settings(platform, peers, storage_dir=str(tmp_path)):
        yield peers


def _imported(
    platform: Any,
    peers: TradingPeers,
    user: str,
    *,
    n: int = 20,
    start: dt.datetime | None = None,
    seed: int = 11,
) -> list[Any]:
    rows = sample_trades("coinbase", n, start=start or days_ago(25), seed=seed)
    connected_user(platform, peers, user, rows=rows)
    handle = submit_import(platform, user)
    assert handle.wait(60) == s.SUCCEEDED
    score = platform.job(job_row(platform, handle.id)["result"]["score_job"])
    assert score.wait(90) == s.SUCCEEDED
    return trades(platform, user)


def test_a_cold_sim_then_the_same_sim_from_the_result_cache(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    trade = _imported(platform, trading, tag)[0]
    cold = submit_sim(platform, tag, trade["id"], 3)
    assert cold.wait(60) == s.SUCCEEDED
    result = cold.result
    assert result["source"] == "primary" and result["cached"] is False and result["partial"] is False
    assert len(result["t"]) == len(result["actual"]) == len(result["hold"]) > 70
    assert isinstance(result["delta"], float)
    asked = trading.market.stats()
    again = submit_sim(platform, tag, trade["id"], 3)  # the first ended: a new job, the cached result
    assert again.id != cold.id and again.wait(60) == s.SUCCEEDED
    assert again.result == {**result, "cached": True}
    assert trading.market.stats() == asked  # no market data asked for a hit


def test_a_horizon_past_now_is_cut_at_now(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    trade = _imported(platform, trading, tag, n=5, start=days_ago(3))[-1]
    handle = submit_sim(platform, tag, trade["id"], 30)
    assert handle.wait(60) == s.SUCCEEDED
    result = handle.result
    assert result["partial"] is True
    end = dt.datetime.fromisoformat(result["end"].replace("Z", "+00:00"))
    assert abs((end - dt.datetime.now(dt.UTC)).total_seconds()) < 120


def test_the_vendor_answers_when_the_primary_fails_and_its_429s_never_dead_letter(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    [first, second, *_] = _imported(platform, trading, tag)
    trading.market.faults(fail_primary=True)
    fallback = submit_sim(platform, tag, first["id"], 2)
    assert fallback.wait(60) == s.SUCCEEDED and fallback.result["source"] == "vendor"
    trading.market.faults(vendor_429=10, retry_after_s=0.2)
    limited = submit_sim(platform, tag, second["id"], 2)
    assert limited.wait(60) == s.SUCCEEDED
    result = limited.result
    assert result["partial"] is True and "429" in result["reason"] and result["cached"] is False
    assert job_row(platform, limited.id)["attempts"] == 1  # two short waits in the body, then an answer


def test_a_trade_not_found_or_another_users_is_skipped_without_saying_whose(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    theirs = _imported(platform, trading, f"{tag}-b", n=3)[0]
    for trade_id in ("no-such-trade", theirs["id"]):
        handle = submit_sim(platform, tag, trade_id, 7)
        assert handle.wait(30) == s.SKIPPED
        row = job_row(platform, handle.id)
        assert [e.body["reason"] for e in handle.events()[0] if e.topic == "job.skipped"] == [
            "trade not found"
        ]
        assert f"{tag}-b" not in json.dumps(row["result"])
    for horizon in (0, 366):
        with pytest.raises(PayloadInvalid, match="horizonDays"):
            submit_sim(platform, tag, theirs["id"], horizon)


def test_a_digest_writes_its_snapshot_then_its_row_and_event_once_per_period(
    platform: Any, trading: TradingPeers, worker: Any, tag: str, tmp_path: Path
) -> None:
    rows = _imported(platform, trading, tag, n=30)
    start = rows[0]["ts"].date()
    end = start + dt.timedelta(days=7)
    handle = submit_digest(platform, tag, start, end)
    assert handle.wait(60) == s.SUCCEEDED
    result = handle.result
    in_window = [r for r in rows if r["ts"].date() < end]
    assert result["trades"] == len(in_window) > 0
    path = tmp_path / "digests" / tag / f"{start}-{end}.json"
    snapshot = json.loads(path.read_text())
    assert snapshot["digestId"] == result["digestId"] and snapshot["trades"] == len(in_window)
    assert sum(snapshot["by_label"].values()) >= len(in_window)
    [ready] = events(platform, handle.id, "digest.ready")
    assert ready == {
        "digestId": result["digestId"],
        "userId": tag,
        "period": {"start": str(start), "end": str(end)},
    }
    again = submit_digest(platform, tag, start, end)
    assert again.id == handle.id  # the same period is one job
    redo = submit_digest(platform, tag, start, end, recompute=True)
    assert redo.id != handle.id and redo.wait(60) == s.SUCCEEDED
    assert redo.result["digestId"] == result["digestId"]
    with platform.engine.connect() as conn:
        n = conn.execute(
            select(func.count()).select_from(t.digests).where(t.digests.c.user_id == tag)
        ).scalar_one()
    assert n == 1


def test_a_quiet_user_gets_zeros_and_bad_periods_are_refused(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    quiet = submit_digest(platform, tag, "2026-01-05", "2026-01-12")
    assert quiet.wait(60) == s.SUCCEEDED and quiet.result["trades"] == 0
    for start, end in (
        ("2026-01-12", "2026-01-05"),
        ("2026-01-05", "2026-01-05"),
        ("2026-01-01", "2026-02-05"),
    ):
        bad = submit_digest(platform, tag, start, end)
        assert bad.wait(30) == s.DEAD
        row = job_row(platform, bad.id)
        assert (
            row["attempts"] == 1
            and row["error_type"] == "PayloadInvalid"
            and "periodEnd" in row["last_error"]
        )


def test_an_unreachable_store_is_transient_and_records_no_row(
    platform: Any, peers: TradingPeers, worker: Any, tag: str
) -> None:
    s3 = {
        "bucket": "digests",
        "endpoint_url": "http://127.0.0.1:9",
        "access_key": "a",
        "secret_key": "b",
        "connect_timeout": 0.5,
        "read_timeout": 0.5,
        "max_attempts": 1,
    }
    with trading_settings(platform, peers, s3=s3):
        handle = submit_digest(platform, tag, "2026-02-02", "2026-02-09")
        eventually(lambda: job_row(platform, handle.id)["status"] == s.RETRYING, timeout=30)
        platform.cancel(handle.id)
    with platform.engine.connect() as conn:
        assert conn.execute(select(t.digests.c.id).where(t.digests.c.user_id == tag)).first() is None


def test_the_fanout_fired_twice_makes_one_digest_per_user_and_period(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    users = [f"{tag}-{i}" for i in range(3)]
    for user in users:
        _imported(platform, trading, user, n=6, start=days_ago(9))
    week = days_ago(9).date()
    first, second = submit_fanout(platform, week), submit_fanout(platform, week)
    assert first.wait(60) == s.SUCCEEDED and second.wait(60) == s.SUCCEEDED
    assert first.result["users"] >= 3
    start, end = week_of(week, dt.date.today())

    def digests_of_users() -> list[Any]:
        with platform.engine.connect() as conn:
            query = select(t.digests).where(
                t.digests.c.user_id.in_(users), t.digests.c.period_start == str(start)
            )
            return list(conn.execute(query).mappings())

    eventually(lambda: len(digests_of_users()) == 3, timeout=90)
    with platform.engine.connect() as conn:
        jobs = (
            conn.execute(
                select(s.jobs.c.id).where(
                    s.jobs.c.stage == "conveyor.trading.digest_weekly",
                    s.jobs.c.label.in_([f"digest {u}" for u in users]),
                )
            )
            .scalars()
            .all()
        )
    assert len(jobs) == 3
    ready = [e for job in jobs for e in events(platform, job, "digest.ready")]
    assert len(ready) == 3 and all(e["period"] == {"start": str(start), "end": str(end)} for e in ready)


def test_market_data_down_retries_then_answers_partially_on_the_last_attempt(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    # A time and horizon whose market-data window no other test put in the cache.
    trade = _imported(platform, trading, tag, n=3, start=days_ago(28), seed=77)[0]
    trading.market.stop()
    try:
        handle = submit_sim(platform, tag, trade["id"], 4)
        assert handle.wait(60) == s.SUCCEEDED
    finally:
        trading.market.start()
    row = job_row(platform, handle.id)
    assert row["attempts"] - row["uncounted"] == 3  # two transient failures first, on the schedule
    result = handle.result
    assert result["partial"] is True and "market data unavailable" in result["reason"]
    assert [e.topic for e in handle.events()[0]].count("job.retrying") == 2
