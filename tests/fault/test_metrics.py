"""What ``conveyor worker --metrics-port`` exports, scraped after a run of a real prefork
worker on services of its own (a private Redis, a scratch Postgres database), so every
value is this test's: job counts by stage and outcome, body durations, queue depth per
queue, live jobs per queue and status, open dead letters and the relay's and outbox's lag,
in base units. With the broker gone a scrape still answers: the counters, and
``conveyor_state_up 0``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import conveyor
from config.migrations import upgrade
from conveyor.delivery.procs import start_worker, stop
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from tests.fault.conftest import wait_ready
from tests.fault.servers import PrivateRedis
from tests.helpers import scratch_database
from tests.integration.http_support import free_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.fault, pytest.mark.redis_broker]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of the endpoint, by name and sorted labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def private_services(platform: Any) -> Iterator[Any]:
    """Settings on a private Redis and a migrated scratch database."""
    redis = PrivateRedis(port=free_port())
    redis.start()
    try:
        with scratch_database("conveyor_metrics") as url:
            engine = make_engine(url, pool_size=1)
            upgrade(engine)
            engine.dispose()
            yield redis, platform.settings.model_copy(update={"redis_url": redis.url, "database_url": url})
    finally:
        redis.shutdown_nosave()


def test_a_scrape_after_a_run_counts_what_happened(private_services: Any, tmp_path: Path) -> None:
    redis, settings = private_services
    port, log = free_port(), tmp_path / "worker.log"
    settings = settings.model_copy(update={"home": tmp_path / "home"})
    worker = start_worker(
        settings, queues=["demo"], concurrency=2, log_path=log, extra_args=["--metrics-port", str(port)]
    )
    client = conveyor.connect(database_url=settings.database_url, redis_url=settings.redis_url)
    try:
        wait_ready(log, worker)
        squares = [client.submit("conveyor.demo.square", {"n": n}) for n in range(5)]
        broken = [client.submit("conveyor.demo.broken", {"n": n}) for n in range(2)]
        later = [client.submit("conveyor.demo.square", {"n": n}, delay=300) for n in range(3)]
        # A queue no worker here consumes: its message waits in the broker.
        client.submit("conveyor.files.extract", {"file_id": "nowhere"})
        assert [j.wait(60) for j in squares] == [s.SUCCEEDED] * 5
        assert [j.wait(60) for j in broken] == [s.DEAD] * 2

        samples = scrape(port)
        assert value(samples, "conveyor_state_up") == 1
        assert value(samples, "conveyor_jobs_succeeded_total", stage="conveyor.demo.square") == 5
        assert value(samples, "conveyor_jobs_dead_total", stage="conveyor.demo.broken") == 2
        assert value(samples, "conveyor_jobs_claimed_total", stage="conveyor.demo.square") == 5
        runtime, square, broken = (
            "conveyor_job_runtime_seconds",
            "conveyor.demo.square",
            "conveyor.demo.broken",
        )
        assert value(samples, f"{runtime}_count", stage=square, status="ok") == 5
        assert 0 < value(samples, f"{runtime}_sum", stage=square, status="ok") < 5
        # Every attempt of a broken job raised: its runtimes count as err.
        assert value(samples, f"{runtime}_count", stage=broken, status="err") >= 2
        assert value(samples, f"{runtime}_count", stage=broken, status="ok") == 0
        assert value(samples, "conveyor_queue_length", queue_name="file-extract") == 1
        assert value(samples, "conveyor_queue_length", queue_name="demo") == 0
        assert value(samples, "conveyor_jobs", queue_name="demo", status=s.QUEUED) == len(later)
        assert value(samples, "conveyor_jobs", queue_name="file-extract", status=s.QUEUED) == 1
        assert value(samples, "conveyor_jobs", queue_name="demo", status=s.RUNNING) == 0
        assert value(samples, "conveyor_dead_letters") == 2
        assert 0 <= value(samples, "conveyor_publish_lag_seconds") < 5
        assert 0 <= value(samples, "conveyor_outbox_lag_seconds") < 5

        redis.shutdown_nosave()  # the broker is gone: the endpoint still answers
        deadline = time.monotonic() + 30
        while value(after := scrape(port), "conveyor_state_up") != 0:
            assert time.monotonic() < deadline, "the scrape never noticed the broker was gone"
            time.sleep(0.5)
        assert value(after, "conveyor_jobs_succeeded_total", stage="conveyor.demo.square") == 5
        assert ("conveyor_queue_length", (("queue_name", "demo"),)) not in after
    finally:
        client.close()
        stop(worker, timeout=10)
