"""Test plumbing: real Redis and Postgres, a fresh database per session, fast timers.

Services missing → the tests skip, unless ``--require-services`` (CI) turns that into a
failure. The environment is set here, before the app module is imported.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.locks import claim_numbered

# Real projects that call Conveyor (tests/projects/*) have their own tests, which the
# integration tests run in those projects' own directories and sessions.
collect_ignore_glob = ["projects/*"]

# CONVEYOR_TEST_BROKER=amqp: the session runs with RabbitMQ as Celery's broker, in a vhost of
# its own on the machine's node (Redis stays for Conveyor's keys and results). tests/rabbit
# holds what only RabbitMQ has; .ci/run runs it with a subset of the other tiers.
ON_AMQP = os.environ.get("CONVEYOR_TEST_BROKER", "redis") == "amqp"
if not ON_AMQP:
    collect_ignore_glob.append("rabbit/*")

REDIS_BASE = os.environ.get("CONVEYOR_TEST_REDIS", "redis://127.0.0.1:6379")
PG_BASE = os.environ.get("CONVEYOR_TEST_PG", "postgresql://postgres@127.0.0.1:5432")


def lock_free_redis_db() -> tuple[int, int]:
    """A Redis DB no other test session on this machine uses (1-11; the benchmarks use
    12-15), and the descriptor whose ``flock`` holds it until it is closed, so holders
    never flush each other's keys."""
    claimed = claim_numbered("conveyor-test-redis-db", range(1, 12))
    if claimed is None:
        raise RuntimeError("more than 11 concurrent test sessions: no free Redis DB")
    return claimed


def _claim_redis_db() -> int:
    """This session's Redis DB, held for the life of the session."""
    db, fd = lock_free_redis_db()
    _held_locks.append(fd)
    return db


_held_locks: list[int] = []
REDIS_DB = _claim_redis_db()
TEST_DB = f"conveyor_test_{os.getpid()}"
HOME = tempfile.mkdtemp(prefix="conveyor-test-")

FAST_TIMERS = {
    "CONVEYOR_LEASE_TIMEOUT": "3",
    "CONVEYOR_HEARTBEAT_INTERVAL": "0.5",
    "CONVEYOR_RELAY_INTERVAL": "0.2",
    "CONVEYOR_RECONCILER_INTERVAL": "0.5",
    "CONVEYOR_VISIBILITY_TIMEOUT": "30",
    "CONVEYOR_DEFAULT_TIME_LIMIT": "20",
    "CONVEYOR_DEFAULT_SOFT_TIME_LIMIT": "15",
    "CONVEYOR_REPUBLISH_AFTER": "10",
    "CONVEYOR_INFRA_BACKOFF": "0.2",
    "CONVEYOR_BACKOFF_BASE": "0.1",
    "CONVEYOR_SOFT_SHUTDOWN_TIMEOUT": "5",
}
os.environ.update(FAST_TIMERS)
os.environ["CONVEYOR_REDIS_URL"] = f"{REDIS_BASE}/{REDIS_DB}"
os.environ["CONVEYOR_DATABASE_URL"] = f"{PG_BASE}/{TEST_DB}"
os.environ["CONVEYOR_HOME"] = HOME
AMQP_VHOST = f"conveyor_test_{os.getpid()}"
if ON_AMQP:
    os.environ["CONVEYOR_BROKER_URL"] = f"amqp://guest:guest@127.0.0.1:5672/{AMQP_VHOST}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On RabbitMQ, the tests about Redis as Celery's broker do not apply."""
    if not ON_AMQP:
        return
    skip = pytest.mark.skip(reason="inspects or breaks Redis as Celery's broker; this session's is RabbitMQ")
    for item in items:
        if item.get_closest_marker("redis_broker") is not None:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-services",
        action="store_true",
        help="fail (instead of skipping) when Redis or Postgres is unreachable",
    )
    parser.addoption(
        "--celery-canvas",
        default="subset",
        help="Celery's own canvas tests against stages (tests/upstream): 'subset' (CI's), "
        "'all' (the whole file), or test ids/classes of test_canvas.py, comma-separated",
    )
    parser.addoption(
        "--celery-canvas-sides",
        default="both",
        choices=("both", "stages"),
        help="'stages': skip the plain Celery side (every failure not listed as a difference fails)",
    )


def _service_problem() -> str | None:
    import psycopg
    import redis

    try:
        redis.Redis.from_url(f"{REDIS_BASE}/0", socket_timeout=2).ping()
    except Exception as exc:
        return f"Redis unreachable at {REDIS_BASE}: {exc}"
    try:
        psycopg.connect(f"{PG_BASE}/postgres", connect_timeout=3).close()
    except Exception as exc:
        return f"Postgres unreachable at {PG_BASE}: {exc}"
    return None


@pytest.fixture(scope="session")
def services(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fresh Postgres database and an empty Redis DB for this session."""
    problem = _service_problem()
    if problem:
        if request.config.getoption("--require-services"):
            pytest.fail(problem)
        pytest.skip(problem)
    import psycopg
    import redis

    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{TEST_DB}"')
    redis.Redis.from_url(os.environ["CONVEYOR_REDIS_URL"]).flushdb()
    if ON_AMQP:
        from tests.rabbit_support import create_vhost

        create_vhost(AMQP_VHOST)
    from config.celery_app import platform
    from config.migrations import upgrade

    platform.app.loader.import_default_modules()
    upgrade(platform.engine)
    yield
    platform.reset()
    if ON_AMQP:
        from tests.rabbit_support import delete_vhost

        delete_vhost(AMQP_VHOST)
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)')


@pytest.fixture(scope="session")
def platform(services: None) -> Any:
    """The deployment's platform, bound to the test services."""
    from config.celery_app import platform as p

    return p


@pytest.fixture(scope="module")
def worker(platform: Any) -> Iterator[Any]:
    """An in-process worker (solo pool, in a thread) with the relay, per test module.

    Module-scoped so that the fault tests' subprocess workers never share a queue with it.
    """
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        platform.app,
        pool="solo",
        concurrency=1,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
        queues=[q.name for q in platform.queues],
    ) as w:
        yield w
    platform.stop_background()


@pytest.fixture
def tag() -> str:
    """A unique tag for this test's ids, keys and rows."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def on_sqlite(platform: Any, tmp_path: Any) -> Iterator[Any]:
    """The test platform pointed at a fresh SQLite file (same Redis), then back."""
    from config.migrations import upgrade
    from conveyor.store.db.engine import make_engine, sqlite_url
    from tests.helpers import bound_to

    url = sqlite_url(tmp_path)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    with bound_to(platform, url):
        yield platform
