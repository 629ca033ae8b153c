"""The trading family's metrics and log fields, scraped from a real prefork worker
(``conveyor worker --metrics-port``) after a run: 429s by source, AI requests by endpoint,
events by topic, the platform's runtime histogram by status; and its log lines carry
``job_id``, ``userId``, ``queue`` and ``attempt``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.delivery.procs import start_worker, stop
from conveyor.store.db import schema as s
from pipelines.trading.jobs import submit_import, submit_sim
from tests.fault.conftest import wait_ready
from tests.fault.test_metrics import scrape, value
from tests.helpers import job_row
from tests.integration.http_support import free_port
from tests.integration.trading_support import (
    connected_user,
    started_peers,
    trades,
    trading_config,
    trading_settings,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault]
QUEUES = ["q_import", "q_score", "q_sim", "q_digest"]


def test_a_scrape_after_a_trading_run_counts_429s_ai_requests_and_events(
    platform: Any, tag: str, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "worker.log"
    with started_peers() as peers, trading_settings(platform, peers):
        connected_user(platform, peers, tag, n=25)
        settings = platform.settings.model_copy(update={"home": tmp_path / "home"})
        worker = start_worker(
            settings,
            queues=QUEUES,
            concurrency=2,
            log_path=log,
            extra_args=["--metrics-port", str(port)],
            extra_env={"CONVEYOR_TRADING": json.dumps(trading_config(peers))},
        )
        try:
            wait_ready(log, worker)
            peers.broker.faults(storm=2, retry_after_s=0.05)
            imported = submit_import(platform, tag)
            assert imported.wait(60) == s.SUCCEEDED
            score = platform.job(job_row(platform, imported.id)["result"]["score_job"])
            assert score.wait(60) == s.SUCCEEDED
            peers.market.faults(fail_primary=True, vendor_429=1, retry_after_s=0.05)
            sim = submit_sim(platform, tag, trades(platform, tag)[0]["id"], 2)
            assert sim.wait(60) == s.SUCCEEDED and sim.result["source"] == "vendor"
            samples = scrape(port)
        finally:
            stop(worker, timeout=20)
    assert value(samples, "trading_vendor_429_total", source="broker") == 2
    assert value(samples, "trading_vendor_429_total", source="vendor") == 1
    for endpoint, at_least in (("/v1/bias", 1), ("/v1/indicators", 25), ("/v1/nlg/reflect", 25)):
        assert value(samples, "trading_ai_request_seconds_count", endpoint=endpoint) >= at_least
    assert value(samples, "trading_outbox_events_total", topic="import.progress") == 1
    assert value(samples, "trading_outbox_events_total", topic="coach.reflect") == 25
    runtime = "conveyor_job_runtime_seconds_count"
    assert value(samples, runtime, stage="conveyor.trading.import_trades", status="ok") == 1
    assert value(samples, runtime, stage="conveyor.trading.score_bias", status="ok") == 1
    lines = [line for line in log.read_text(errors="replace").splitlines() if f"userId={tag}" in line]
    assert lines, "no log line names the user"
    assert any(all(f"{k}=" in line for k in ("job_id", "queue", "attempt")) for line in lines)
    assert any("resets in" in line for line in lines)  # 429s logged with their reset time
