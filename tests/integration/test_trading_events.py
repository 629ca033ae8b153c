"""The trading family's events through the HTTP API's feed (the seed's
``/internal/events?since``): an import's progress, its success, then its score's
``coach.reflect`` events, in commit order, for the owner who submitted the import."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_import
from pipelines.trading.peers import TradingPeers
from tests.helpers import job_row
from tests.integration.http_support import Token, auth, token_fixture
from tests.integration.trading_support import connected_user, started_peers, trading_settings

pytestmark = pytest.mark.timeout(180)
token = token_fixture("read")


@pytest.fixture(scope="module")
def peers() -> Iterator[TradingPeers]:
    with started_peers() as running:
        yield running


def _feed(http: TestClient, secret: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params = {"limit": 500, **({"since": cursor} if cursor else {})}
        page = http.get("/events", params=params, headers=auth(secret))
        assert page.status_code == 200, page.text
        found += page.json()["events"]
        if page.json()["cursor"] == cursor or not page.json()["events"]:
            return found
        cursor = page.json()["cursor"]


def test_import_progress_then_score_reflections_arrive_in_order(
    platform: Any, peers: TradingPeers, worker: Any, http: TestClient, token: Token, tag: str
) -> None:
    owner = f"trader-{tag}"
    secret = token(owner)
    with trading_settings(platform, peers):
        connected_user(platform, peers, tag, n=60, owner=owner)
        handle = submit_import(platform, tag, owner=owner)
        assert handle.wait(60) == s.SUCCEEDED
        score = platform.job(job_row(platform, handle.id)["result"]["score_job"])
        assert score.wait(90) == s.SUCCEEDED
    feed = _feed(http, secret)
    topics = [(e["job_id"], e["topic"]) for e in feed]
    progress = [i for i, (job, topic) in enumerate(topics) if (job, topic) == (handle.id, "import.progress")]
    imported = topics.index((handle.id, "job.succeeded"))
    reflections = [i for i, (job, topic) in enumerate(topics) if (job, topic) == (score.id, "coach.reflect")]
    assert len(progress) == 2 and len(reflections) == 60
    assert max(progress) < imported < min(reflections)
    assert topics.index((score.id, "job.succeeded")) > max(reflections)
    told = [e for e in feed if e["topic"] == "coach.reflect"]
    assert len({e["body"]["tradeId"] for e in told}) == 60 and all(e["body"]["userId"] == tag for e in told)
