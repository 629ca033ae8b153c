"""Multi-host plumbing: one bridge, private Redis and Postgres on it, per test module;
hosts per test. The test process's platform is bound to those services meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.harness import Cluster, can_run, cluster, describe, timer_env

# Short timers (printed by every test): a cut or killed host's jobs are taken over after
# lease_timeout + reconciler_interval. Client keepalives outlast a test's link cut, so the
# stale owner's late completion reaches Postgres (and is refused) instead of failing on a
# connection its kernel dropped meanwhile.
TIMERS = timer_env(
    lease_timeout=3,
    heartbeat_interval=0.5,
    relay_interval=0.2,
    reconciler_interval=0.5,
    worker_alive_ttl=4,
    visibility_timeout=30,
    default_time_limit=25,
    default_soft_time_limit=20,
    republish_after=10,
    db_keepalives_idle=10,
    db_keepalives_interval=1,
    db_keepalives_count=3,
    broker_heartbeat=2,
)


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def mh(
    platform: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """A cluster (network and services, no hosts yet) for the module's tests, with Redis
    as the broker, then with a private RabbitMQ node on the bridge."""
    problem = can_run()
    if problem:
        pytest.skip(problem)
    log_dir = Path(tmp_path_factory.mktemp("multihost"))
    before = platform.settings
    with cluster(platform.settings, log_dir, env=TIMERS, rabbitmq=request.param == "rabbitmq") as c:
        platform.bind(
            redis_url=c.services.redis_url,
            database_url=c.services.database_url,
            broker_url=c.services.broker_url,
        )
        try:
            yield c
        finally:
            platform.bind(
                redis_url=before.redis_url, database_url=before.database_url, broker_url=before.broker_url
            )


@pytest.fixture
def hosts(mh: Cluster) -> Iterator[Cluster]:
    """The cluster, whose hosts are all removed after the test (their logs' tails are
    printed when it failed)."""
    print(f"settings of this run:\n{describe(mh.env)}")
    try:
        yield mh
    finally:
        for host in mh.hosts:
            for worker in host.workers:
                print(f"--- {worker.log.name} (tail)\n{worker.text()[-1500:]}")
        mh.destroy_hosts()
