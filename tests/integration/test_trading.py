"""The trading family end to end with an in-process worker and the real peers (HTTP on
loopback): import → score → ``coach.reflect``, pages served twice, malformed rows, rate
limits that never cost an attempt, and the bad inputs a caller can send."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.errors import PayloadInvalid
from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_import, submit_score
from pipelines.trading.peers import TradingPeers
from pipelines.trading.peers.broker import sample_trades
from tasks.trading import tables as t
from tasks.trading.models import SCORE_STAGE
from tests.helpers import dead_letter_for, eventually, job_row
from tests.integration.trading_support import (
    connected_user,
    count,
    days_ago,
    events,
    reflect_events,
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
def trading(platform: Any, peers: TradingPeers) -> Iterator[TradingPeers]:
    peers.broker.faults(clear=True)
    peers.coach.faults(clear=True)
    peers.market.faults(clear=True)
    with trading_settings(platform, peers):
        yield peers


def _score_of(platform: Any, import_job: str) -> Any:
    result = job_row(platform, import_job)["result"]
    return platform.job(result["score_job"])


def test_import_then_score_tags_every_trade_and_tells_each_once(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    connected_user(platform, trading, tag, n=120)
    handle = submit_import(platform, tag)
    assert handle.wait(90) == s.SUCCEEDED
    result = job_row(platform, handle.id)["result"]
    assert {k: result[k] for k in ("fetched", "stored", "rejected", "pages")} == {
        "fetched": 120,
        "stored": 120,
        "rejected": 0,
        "pages": 3,
    }
    assert result["since"] == (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=30)).isoformat()
    progress = events(platform, handle.id, "import.progress")
    assert [p["fetched"] for p in progress] == [50, 100, 120] and progress[-1]["percent"] == 100.0
    assert all(p["jobId"] == handle.id for p in progress)
    score = _score_of(platform, handle.id)
    assert score.wait(120) == s.SUCCEEDED
    stored = {r["id"] for r in trades(platform, tag)}
    told = reflect_events(platform, tag)
    assert len(told) == 120 and {e["tradeId"] for e in told} == stored  # each trade once
    first = told[0]
    assert first["tone"] == "supportive" and first["insight"] and first["labels"]
    assert all(0 <= x <= 1 for x in first["sparklines"])
    with platform.engine.connect() as conn:
        tagged = set(conn.execute(select(t.tags.c.trade_id).where(t.tags.c.user_id == tag)).scalars())
    assert tagged == stored  # at least one tag per trade (neutral when nothing fired)
    assert job_row(platform, score.id)["result"]["reflected"] == 120
    assert trading.coach.stats()["rejected"] == {}


def test_a_page_served_twice_and_a_repeat_import_store_each_trade_once(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    rows = sample_trades("binance", 40, start=days_ago(10), seed=3)
    served = rows[:30] + rows[20:40] + rows[:5]  # the broker repeats rows across pages
    connected_user(platform, trading, tag, broker="binance", rows=served)
    trading.broker.faults(page_size=25)
    first = submit_import(platform, tag, broker="binance")
    assert first.wait(60) == s.SUCCEEDED
    result = job_row(platform, first.id)["result"]
    assert (result["fetched"], result["stored"], result["rejected"]) == (55, 40, 0)
    assert count(platform, t.trades, tag) == 40
    _score_of(platform, first.id).wait(60)
    again = submit_import(platform, tag, broker="binance")  # a later re-import runs
    assert again.id != first.id and again.wait(60) == s.SUCCEEDED
    assert job_row(platform, again.id)["result"]["stored"] == 0
    ids = {r["ext_id"]: r["id"] for r in trades(platform, tag)}
    assert len(ids) == 40  # the trade ids did not change either


def test_malformed_rows_are_counted_and_recorded_without_their_values(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    good = sample_trades("coinbase", 6, start=days_ago(5), seed=9)
    bad: list[Any] = [
        {**good[0], "trade_id": "no-price", "price": None},
        {**good[0], "trade_id": "nan-size", "size": "lots-of-secret-ish"},
        {**good[0], "trade_id": "neg", "size": "-1"},
        {**good[0], "trade_id": "side", "side": "hodl"},
        {**good[0], "trade_id": "when", "created_at": "yesterday-ish"},
        "not an object",
    ]
    connected_user(platform, trading, tag, rows=good + bad)
    handle = submit_import(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    result = job_row(platform, handle.id)["result"]
    assert (result["fetched"], result["stored"], result["rejected"]) == (12, 6, 6)
    with platform.engine.connect() as conn:
        rejects = list(conn.execute(select(t.rejects).where(t.rejects.c.user_id == tag)).mappings())
    assert {r["ext_id"] for r in rejects} == {"no-price", "nan-size", "neg", "side", "when", None}
    assert all(r["job_id"] == handle.id and r["page"] == 1 for r in rejects)
    reasons = " ".join(r["reason"] for r in rejects)
    assert "lots-of-secret-ish" not in reasons and "hodl" not in reasons and "yesterday-ish" not in reasons


def test_a_429_storm_defers_the_import_without_counting_an_attempt(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    connected_user(platform, trading, tag, n=30)
    trading.broker.faults(storm=3, retry_after_s=0.2)
    handle = submit_import(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    row = job_row(platform, handle.id)
    assert row["attempts"] - row["uncounted"] == 1 and row["requeues"] == 0
    deferred = [e for e in handle.events()[0] if e.topic == "job.deferred"]
    assert len(deferred) == 3 and all(e.body["seconds"] == pytest.approx(0.25) for e in deferred)
    assert "429" in deferred[0].body["reason"] and f"tok-{tag}" not in deferred[0].body["reason"]


def test_a_spent_rate_limit_window_is_waited_out_in_the_body(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    connected_user(platform, trading, tag, n=100)
    trading.broker.faults(page_size=10, rate_per_s=3)
    handle = submit_import(platform, tag)
    assert handle.wait(60) == s.SUCCEEDED
    row = job_row(platform, handle.id)
    assert row["result"]["pages"] == 10 and row["attempts"] == 1  # no 429 ever answered
    assert all(entry["status"] == 200 for entry in trading.broker.log() if entry["user"] == tag)


def test_an_unreadable_page_is_retried_from_the_last_committed_cursor(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    connected_user(platform, trading, tag, n=120)
    trading.broker.faults(garbage_page=2)
    handle = submit_import(platform, tag)
    eventually(lambda: job_row(platform, handle.id)["status"] == s.RETRYING, timeout=30)
    row = job_row(platform, handle.id)
    assert "page 2" in row["last_error"] and count(platform, t.trades, tag) == 50
    trading.broker.faults(clear=True)
    assert handle.wait(60) == s.SUCCEEDED
    pages = [e["page"] for e in trading.broker.log() if e["user"] == tag]
    assert pages == [1, 2, 2, 3]  # page 1 committed: never fetched again


def test_bad_inputs_get_clear_answers(platform: Any, trading: TradingPeers, worker: Any, tag: str) -> None:
    for payload in (
        {"userId": "someone@example.com"},
        {"userId": ".."},
        {"userId": tag, "sinceIso": "2025-13-01"},
    ):
        with pytest.raises(PayloadInvalid):
            submit_import(platform, payload["userId"], since=payload.get("sinceIso"))
    with pytest.raises(PayloadInvalid, match="broker"):
        submit_import(platform, tag, broker="kraken")
    future = submit_import(platform, tag, since=dt.date.today() + dt.timedelta(days=3))
    assert future.wait(30) == s.DEAD
    assert "in the future" in job_row(platform, future.id)["last_error"]
    nobody = submit_import(platform, f"{tag}-nobody")
    assert nobody.wait(30) == s.DEAD
    assert f"user {tag}-nobody has no broker connection" in job_row(platform, nobody.id)["last_error"]


def test_a_revoked_token_dead_letters_naming_user_and_broker_never_the_token(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    token, rows = connected_user(platform, trading, tag, n=5)
    trading.broker.set_user(tag, "coinbase", f"rotated-{tag}", rows)  # the stored one is refused
    handle = submit_import(platform, tag)
    assert handle.wait(30) == s.DEAD
    row = job_row(platform, handle.id)
    assert row["attempts"] == 1 and f"of user {tag}" in row["last_error"] and "coinbase" in row["last_error"]
    assert token not in (row["last_error"] or "")
    dead = dead_letter_for(platform, handle.id)
    assert dead["error_type"] == "BrokerUnauthorized" and token not in str(dict(dead))


def test_a_repeat_while_pending_returns_the_job(platform: Any, trading: TradingPeers, tag: str) -> None:
    # No worker in this module runs before this test's submits are compared.
    first = submit_score(platform, tag, since="2025-01-01")
    second = submit_score(platform, tag, since="2025-01-01")
    assert second.id == first.id and second.deduplicated
    other = submit_score(platform, tag, since="2025-01-02")
    assert other.id != first.id
    assert job_row(platform, first.id)["stage"] == SCORE_STAGE


def test_import_then_score_on_the_embedded_default_sqlite(
    on_sqlite: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    rows = sample_trades("coinbase", 30, start=days_ago(6), seed=5)
    connected_user(on_sqlite, trading, tag, rows=rows + rows[:4])
    handle = submit_import(on_sqlite, tag)
    assert handle.wait(60) == s.SUCCEEDED
    result = job_row(on_sqlite, handle.id)["result"]
    assert (result["fetched"], result["stored"]) == (34, 30)
    assert _score_of(on_sqlite, handle.id).wait(60) == s.SUCCEEDED
    assert len({e["tradeId"] for e in reflect_events(on_sqlite, tag)}) == 30
    assert count(on_sqlite, t.tags, tag) >= 30


def test_the_ai_coach_down_dead_letters_the_score_after_three_attempts_naming_the_endpoint(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    connected_user(platform, trading, tag, n=5)
    trading.coach.faults(down=True)
    imported = submit_import(platform, tag)
    assert imported.wait(60) == s.SUCCEEDED
    score = _score_of(platform, imported.id)
    assert score.wait(60) == s.DEAD
    row = job_row(platform, score.id)
    assert row["attempts"] - row["uncounted"] == 3
    assert "/v1/bias" in row["last_error"] and "gave up after 3 of 3 attempts" in row["last_error"]


def test_an_import_again_tells_only_the_new_trades_and_keeps_rejects_uncounted_twice(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    from pipelines.trading.jobs import user_status

    rows = sample_trades("coinbase", 40, start=days_ago(12), seed=21)
    bad = {**rows[0], "trade_id": "bad-row", "price": "n/a"}
    connected_user(platform, trading, tag, rows=[*rows[:30], bad])
    first = submit_import(platform, tag)
    assert first.wait(60) == s.SUCCEEDED and _score_of(platform, first.id).wait(90) == s.SUCCEEDED
    assert len(reflect_events(platform, tag)) == 30
    trading.broker.set_user(tag, "coinbase", f"tok-{tag}-canary", [*rows, bad])  # ten more, the bad row again
    again = submit_import(platform, tag)
    assert again.wait(60) == s.SUCCEEDED and job_row(platform, again.id)["result"]["stored"] == 10
    rescored = _score_of(platform, again.id)
    assert rescored.wait(90) == s.SUCCEEDED
    told = [e["tradeId"] for e in reflect_events(platform, tag)]
    assert len(told) == 40 and len(set(told)) == 40  # the 30 already told are not told again
    standing = user_status(platform, tag)
    assert (standing["trades"], standing["rejected"], standing["reflect_events"]) == (40, 1, 40)
    # An explicit re-score (the seed's) tags the window again, replacing the tags.
    retag = submit_score(platform, tag)
    assert retag.wait(90) == s.SUCCEEDED and job_row(platform, retag.id)["result"]["reflected"] == 40


def test_a_job_of_another_owner_for_a_user_does_nothing(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    from pipelines.trading.jobs import connect_broker

    rows = sample_trades("coinbase", 10, start=days_ago(8), seed=4)
    trading.broker.set_user(tag, "coinbase", f"tok-{tag}", rows)
    connect_broker(platform, tag, "coinbase", f"tok-{tag}", owner=f"alice-{tag}")
    start = days_ago(8).date()
    # As POST /jobs would submit them for another token's owner: by name, no trading route.
    theirs = [
        platform.submit("conveyor.trading.import_trades", {"userId": tag}, owner=f"bob-{tag}"),
        platform.submit(
            "conveyor.trading.digest_weekly",
            {"userId": tag, "periodStart": str(start), "periodEnd": str(start + dt.timedelta(days=7))},
            owner=f"bob-{tag}",
        ),
        platform.submit(
            "conveyor.trading.simulate_simple",
            {"userId": tag, "tradeId": "x", "horizonDays": 2},
            owner=f"bob-{tag}",
        ),
    ]
    for handle in theirs:
        assert handle.wait(30) == s.DEAD
        row = job_row(platform, handle.id)
        assert row["error_type"] == "NotYourUser" and f"alice-{tag}" not in row["last_error"]
    assert count(platform, t.trades, tag) == 0
    assert all(e["user"] != tag for e in trading.broker.log())  # Alice's token never used
    mine = submit_import(platform, tag, owner=f"alice-{tag}")
    assert mine.wait(60) == s.SUCCEEDED and count(platform, t.trades, tag) == 10


def test_a_digest_of_a_period_not_over_is_refused(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    today = dt.datetime.now(dt.UTC).date()
    from pipelines.trading.jobs import submit_digest

    running = submit_digest(platform, tag, today - dt.timedelta(days=3), today + dt.timedelta(days=4))
    assert running.wait(30) == s.DEAD
    assert "is after today" in job_row(platform, running.id)["last_error"]
    done = submit_digest(platform, tag, today - dt.timedelta(days=7), today)
    assert done.wait(30) == s.SUCCEEDED


def test_the_cli_lists_trades_and_says_why_a_job_did_not_succeed(
    platform: Any, trading: TradingPeers, worker: Any, tag: str
) -> None:
    from fastapi.testclient import TestClient

    import conveyor as c
    from conveyor.web import create_app, tokens
    from pipelines.trading.http import router
    from tests.integration.test_trading_callers import conveyor

    connected_user(platform, trading, tag, n=12)
    imported = conveyor(platform, "import", "--user", tag, "--wait", "60")
    assert imported.returncode == 0, imported.stderr
    assert "stored=12" in imported.stdout and "score_job=" in imported.stdout
    listed = conveyor(platform, "trades", "--user", tag, "--limit", "5", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert len(rows) == 5 and {r["tradeId"] for r in rows} <= {r["id"] for r in trades(platform, tag)}
    skipped = conveyor(platform, "sim", "--user", tag, "--trade", "no-such-trade", "--horizon", "3")
    assert skipped.returncode == 1 and "skipped: trade not found" in skipped.stderr
    dead = conveyor(platform, "digest", "--user", tag, "--start", "2026-01-12", "--end", "2026-01-05")
    assert dead.returncode == 1 and "error: periodEnd" in dead.stderr
    client = c.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    try:
        with TestClient(create_app(client, routers=[router])) as api:
            secret = tokens.create(platform.engine, owner=f"ops-{tag}", scopes=("admin",)).secret
            got = api.get(
                f"/trading/users/{tag}/trades",
                params={"limit": 3},
                headers={"Authorization": f"Bearer {secret}"},
            )
            assert got.status_code == 200, got.text
            assert [r["tradeId"] for r in got.json()] == [r["tradeId"] for r in rows[:3]]
    finally:
        client.close()
