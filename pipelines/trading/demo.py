"""The trading family in ``conveyor demo``: the broker, AI-coach and market-data peers the
demo starts before its worker (the worker's ``CONVEYOR_TRADING`` names them), one demo user
whose broker serves :data:`SAMPLES` sample trades, and that user's import (then its score)
submitted when the self-check starts. The check: every trade stored, tagged, and reflected
on once (``coach.reflect``); then a sim of the first trade (hold vs. actual over 7 days)
and the digest of the first week, its snapshot written and ``digest.ready`` emitted."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import exists, func, select

from conveyor.platform import Platform
from conveyor.store.db import schema as s

SAMPLES = 120
BROKER = "coinbase"
BROKER_TOKEN = "demo-token"
AI_KEY_ID = "dev"
AI_SECRET = "dev-secret"
TIMEOUT = 90.0  # seconds for the import and its score together
_running: dict[str, Any] = {}


@contextmanager
def peers() -> Iterator[dict[str, str]]:
    """Start the trading peers with one demo user on the broker; yield the worker's extra
    environment naming them."""
    from cryptography.fernet import Fernet

    from pipelines.trading.peers import TradingPeers
    from pipelines.trading.peers.broker import sample_trades

    # A user of this run only: the demo's home (and its database) may be used again.
    user = f"demo-trader-{uuid.uuid4().hex[:6]}"
    # Within the import's default window (the last 30 days), ending before now.
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=25)
    trades = sample_trades(BROKER, SAMPLES, start=start)
    with TradingPeers(ai_key_id=AI_KEY_ID, ai_secret=AI_SECRET) as running:
        running.broker.set_user(user, BROKER, BROKER_TOKEN, trades)
        urls = running.urls()
        settings = {
            "broker_urls": {BROKER: urls["broker"]},
            "market_url": urls["market"],
            "ai_url": urls["ai"],
            "ai_key_id": AI_KEY_ID,
            "ai_secret": AI_SECRET,
            # The demo's own key: the token it stores is read by its worker alone, whatever
            # CONVEYOR_TRADING the shell has.
            "token_key": Fernet.generate_key().decode(),
        }
        _running.update(peers=running, settings=settings, user=user, samples=len(trades))
        try:
            yield {"CONVEYOR_TRADING": json.dumps(settings)}
        finally:
            _running.clear()


def _with_settings(platform: Platform) -> Any:
    from tasks.trading.settings import TradingSettings

    before = getattr(platform.settings, "trading", None)
    platform.settings.trading = TradingSettings.model_validate(_running["settings"])  # type: ignore[attr-defined]
    return before


def start(platform: Platform) -> None:
    """Connect the demo user's broker and submit their import (if the peers run)."""
    from pipelines.trading.jobs import connect_broker, submit_import

    if "peers" not in _running:
        return
    before = _with_settings(platform)
    try:
        connect_broker(platform, _running["user"], BROKER, BROKER_TOKEN)
        _running["import"] = submit_import(platform, _running["user"]).id
    finally:
        if before is not None:
            platform.settings.trading = before  # type: ignore[attr-defined]


def _wait(platform: Platform, job_id: str, deadline: float) -> str:
    try:
        return platform.job(job_id).wait(timeout=max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        return platform.job(job_id).status()


def check(platform: Platform) -> list[tuple[str, bool, str]]:
    """The import stored every sample trade; its score tagged each (at least one tag) and
    emitted one ``coach.reflect`` per trade."""
    from pipelines.trading.jobs import user_status

    if "import" not in _running:
        return [("trading: skipped", True, "the running worker's CONVEYOR_TRADING decides where imports go")]
    user, samples = _running["user"], _running["samples"]
    deadline = time.monotonic() + TIMEOUT
    imported = _wait(platform, _running["import"], deadline)
    result = platform.job(_running["import"]).result if imported == s.SUCCEEDED else None
    counts = result if isinstance(result, dict) else {}
    score_job = counts.get("score_job")
    scored = _wait(platform, str(score_job), deadline) if score_job else "not submitted"
    standing = user_status(platform, user)
    untagged = _untagged(platform, user)
    return [
        *_import_checks(imported, scored, counts, standing, untagged, samples),
        *_later(platform, user, deadline),
    ]


def _import_checks(
    imported: str, scored: str, counts: dict[str, Any], standing: dict[str, Any], untagged: int, samples: int
) -> list[tuple[str, bool, str]]:
    return [
        (
            f"{samples} trades imported through the local broker peer",
            imported == s.SUCCEEDED and standing["trades"] == samples,
            f"status {imported}, fetched={counts.get('fetched', 0)} stored={standing['trades']} "
            f"rejected={standing['rejected']}",
        ),
        (
            "every trade bias-tagged and reflected on once (coach.reflect)",
            scored == s.SUCCEEDED
            and standing["trades"] > 0
            and untagged == 0
            and standing["reflect_events"] == standing["trades"],
            f"score {scored}, tags={standing['tags']} untagged={untagged} "
            f"reflect_events={standing['reflect_events']}",
        ),
    ]


def _later(platform: Platform, user: str, deadline: float) -> list[tuple[str, bool, str]]:
    """A sim of the user's first trade and the digest of its week."""
    from pipelines.trading.jobs import submit_digest, submit_sim
    from tasks.trading import tables as t

    with platform.engine.connect() as conn:
        first = conn.execute(
            select(t.trades.c.id, t.trades.c.ts)
            .where(t.trades.c.user_id == user)
            .order_by(t.trades.c.ts)
            .limit(1)
        ).first()
    if first is None:
        return [("a sim and a digest", False, "no trade to simulate")]
    sim = submit_sim(platform, user, first.id, 7)
    start = first.ts.date()
    digest = submit_digest(platform, user, start, start + dt.timedelta(days=7))
    simmed, digested = _wait(platform, sim.id, deadline + 30), _wait(platform, digest.id, deadline + 30)
    sim_result = sim.result if simmed == s.SUCCEEDED else {}
    digest_result = digest.result if digested == s.SUCCEEDED else {}
    return [
        (
            "a sim of the first trade: hold vs. actual over 7 days",
            simmed == s.SUCCEEDED and len(sim_result.get("t", [])) > 1,
            f"status {simmed}, delta={sim_result.get('delta')} source={sim_result.get('source')} "
            f"points={len(sim_result.get('t', []))}",
        ),
        (
            "the digest of the first week: snapshot, row and digest.ready",
            digested == s.SUCCEEDED and digest_result.get("trades", 0) > 0,
            f"status {digested}, trades={digest_result.get('trades')} "
            f"snapshot={digest_result.get('snapshot')}",
        ),
    ]


def _untagged(platform: Platform, user: str) -> int:
    from conveyor.store.db.namespace import use_schema
    from tasks.trading import tables as t

    tagged = exists().where(t.tags.c.trade_id == t.trades.c.id)
    query = select(func.count()).select_from(t.trades).where(t.trades.c.user_id == user, ~tagged)
    with platform.engine.connect() as raw:
        return int(use_schema(raw, platform.settings.db_schema).execute(query).scalar_one())
